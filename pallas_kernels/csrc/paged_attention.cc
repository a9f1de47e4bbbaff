// Paged attention on CPU, as an XLA FFI custom call (pallas_kernels/cpu_attention.py).
//
// After this step's keys and values are written into the pool (XLA's scatter, in place), token t of
// sequence row s attends to positions 0 .. positions[t] of s, read in place from layer `layer` of
// the pool [L, N, page_size, Hkv, D] through page_table[s]. One work item is a run of consecutive
// tokens of one row (up to kMaxQueries / G) and one kv head: each block of kKeys positions is read
// once for all the item's G-headed queries (csrc/attention_blocks.h lays it out), which go through it
// kQB at a time into an online softmax (float32 scores, sums and exp). Each query's sums are chains
// of its own, so a token's result does not depend on the rest of the step or on how it is split
// into items. Padding tokens (seq_ids[t] >= num_seqs) get zeros.
//
// q is float32 (scaled here, as it is copied) or, over a bfloat16 pool, bfloat16: then the products
// are bfloat16 ones (`vdpbf16ps`), the scores scaled after them, as the Pallas kernels multiply on
// the GPU. The pool is float32, uint16 holding bfloat16 bits, or uint8 holding float8_e4m3fn bits
// (both widened exactly for float32 products), as pool_storage_dtype keeps it; an fp8 pool's scales
// are folded into q and the output by the caller (pallas_kernels/kv_quant.py).
//
// Local layers (InfirePagedAttentionLocal, with the layer's chunk and window as S32 scalars): token t
// sees positions first_visible(positions[t]) .. positions[t] only (pallas_kernels/metadata.py's
// LocalMask), and an item's key loop starts at its first token's first visible position, so pages
// before it (the null page, once the hybrid cache frees them) are never read. InfirePagedAttention is
// the same code with chunk = window = 0.
//
// Attention sinks (InfirePagedAttentionSinks: the local target's buffers and a float32 logit per query
// head, gpt-oss's): one more softmax column per query, that logit with a value of 0, so it joins the
// final normalisation only: out = acc e^(m - m') / (l e^(m - m') + e^(sink - m')), m' = max(m, sink).
// The chunk and window buffers are 0, 0 for a global layer.
//
// The reference attention (pallas_kernels/reference.py) gathers each row's pages into new arrays
// every layer and runs as a string of small ops, one after another; here nothing is copied.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "attention_blocks.h"
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::run_chunks;

namespace {

using namespace infire::attention;
constexpr int kMaxGroup = 16;   // query heads per kv head (at most kMaxQueries)

struct Args {
  const void* q;        // [T, Hq, D]: float32, or bfloat16 bits with a bfloat16 pool (bfloat16 products)
  float scale;          // the scores' scale
  const void* k;        // layer `layer` of the pool: [N, ps, Hkv, D]
  const void* v;
  const int32_t* positions;
  const int32_t* page_table;  // [S, P]
  int64_t pages_per_seq, num_pages, page_size, hkv, group, dim;
  float* out;           // [T, Hq, D]
  int64_t chunk, window;  // a local layer's mask (metadata.LocalMask); 0, 0 for a global layer
  const float* sinks;   // [Hq], already in the scaled scores' units; nullptr: no sinks
};

// The first position a query at `pos` sees (metadata.first_visible): its chunk's start, or its window's.
inline int64_t first_visible(int64_t pos, int64_t chunk, int64_t window) {
  int64_t start = chunk > 0 ? pos - pos % chunk : 0;
  if (window > 0) start = std::max(start, pos - window + 1);
  return std::max<int64_t>(start, 0);
}

// Tokens t0 .. t0 + nt - 1 of sequence row `row`; bf16: bfloat16 products (its row's run is long enough).
struct Item { int64_t t0, nt, row; bool bf16; };

// bfloat16 products go to rows of at least this many tokens in a step (prompt chunks): their blocks are
// laid out for many queries at once. A decode row (1 token) or a speculative one (K + 1) keeps float32
// products, which read a long context faster when few queries share each block, and so a verifying
// step's tokens equal a plain decode's bit for bit.
constexpr int64_t kBf16MinTokens = 32;

// The value sums of QB queries over every vector of dims, 4 vectors at a time.
template <int QB, typename Block>
inline void value_sums(const Block& blk, float* acc, const float* p, const float* alpha, int64_t nb) {
  const int64_t nv = blk.D / 16;
  int64_t j0 = 0;
  for (; j0 + 4 <= nv; j0 += 4) blk.template value_sums<QB, 4>(acc, p, alpha, j0, nb);
  switch (nv - j0) {
    case 3: blk.template value_sums<QB, 3>(acc, p, alpha, j0, nb); break;
    case 2: blk.template value_sums<QB, 2>(acc, p, alpha, j0, nb); break;
    case 1: blk.template value_sums<QB, 1>(acc, p, alpha, j0, nb); break;
    default: break;
  }
}

// The online-softmax step of QB queries q0.. of an item over the block at p0: scores, each query's
// visible lanes ([lo, hi]: at or before its token, from its first visible position; none: the block
// leaves it unchanged), its new max and sum, then the value sums.
template <int QB, typename Block>
void block_step(const Block& blk, int64_t q0, int64_t p0, int64_t nb, const int64_t* lo, const int64_t* hi,
                float* m, float* l, float* acc) {
  v16 s[kQB][kSub];
  blk.template scores<QB>(q0, s);
  alignas(64) float p[QB * kKeys];
  float alpha[QB];
  const i16x lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int i = 0; i < QB; ++i) {
    if (lo[i] > hi[i]) {  // nothing of the block is visible: p = 0, alpha = 1 leave its sums as they are
      alpha[i] = 1.0f;
      std::fill(p + i * kKeys, p + (i + 1) * kKeys, 0.0f);
      continue;
    }
    v16 mx = splat(-INFINITY);
    const bool whole = lo[i] == p0 && hi[i] == p0 + kKeys - 1;  // most blocks of a long prompt: no mask
    for (int c = 0; c < kSub; ++c) {
      const i16x pos = lane + int32_t(p0 + 16 * c);
      if (!whole) s[i][c] = (pos >= int32_t(lo[i])) & (pos <= int32_t(hi[i])) ? s[i][c] : splat(-INFINITY);
      mx = mx > s[i][c] ? mx : s[i][c];
    }
    const float m_new = std::max(m[i], hmax(mx));
    alpha[i] = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
    v16 sum = v16{};
    for (int c = 0; c < kSub; ++c) {
      const v16 e = exp16(s[i][c] - m_new);
      store(p + i * kKeys + 16 * c, e);
      sum += e;
    }
    l[i] = l[i] * alpha[i] + hsum(sum);
    m[i] = m_new;
  }
  value_sums<QB>(blk, acc + q0 * blk.D, p, alpha, nb);
}

// One item and kv head h: its nt x G queries against positions (its first token's first visible
// position) .. (its last token's position), in blocks of kKeys read once for all the item's queries,
// which go through each block kQB at a time. kLocal false (chunk = window = 0): the loop starts at 0.
template <typename P, typename Block, bool kLocal>
void attend(const Args& a, const Item& it, int64_t h) {
  const int64_t G = a.group, D = a.dim, nv = D / 16, hq = a.hkv * G, nq = it.nt * G;
  const int64_t last = a.positions[it.t0 + it.nt - 1];
  const int32_t* table = a.page_table + it.row * a.pages_per_seq;
  const P* kp = static_cast<const P*>(a.k);
  const P* vp = static_cast<const P*>(a.v);
  thread_local Block blk;
  alignas(64) thread_local float acc[kMaxQueries * kMaxDim];
  float m[kMaxQueries], l[kMaxQueries];
  int64_t first[kMaxQueries], pos[kMaxQueries];  // each query's first visible position and its own
  blk.D = D;
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t t = it.t0 + qi / G;
    pos[qi] = a.positions[t];
    first[qi] = kLocal ? first_visible(pos[qi], a.chunk, a.window) : 0;
    blk.set_query(qi, static_cast<const typename Block::Query*>(a.q) + (t * hq + h * G + qi % G) * D, a.scale);
  }
  std::fill(acc, acc + nq * D, 0.0f);
  std::fill(m, m + nq, -INFINITY);
  std::fill(l, l + nq, 0.0f);
  auto row_offset = [&](int64_t p) {  // position p's key (and value) row for head h
    const int64_t page = std::clamp<int64_t>(table[std::min(p / a.page_size, a.pages_per_seq - 1)], 0,
                                             a.num_pages - 1);
    return ((page * a.page_size + p % a.page_size) * a.hkv + h) * D;
  };
  const int64_t row_bytes = D * int64_t(sizeof(P));
  for (int64_t p0 = first[0]; p0 <= last; p0 += kKeys) {
    const int64_t nb = std::min<int64_t>(kKeys, last + 1 - p0);
    // The next block's rows are fetched while this one is computed: the rows are short and strided
    // (the other heads' rows lie between them), which the hardware prefetcher follows poorly.
    for (int64_t p = p0 + kKeys; p <= std::min(last, p0 + 2 * kKeys - 1); ++p) {
      const int64_t offset = row_offset(p);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kp + offset) + byte);
        __builtin_prefetch(reinterpret_cast<const char*>(vp + offset) + byte);
      }
    }
    blk.fill(kp, vp, nb, [&](int64_t key) { return row_offset(p0 + key); });
    for (int64_t q0 = 0; q0 < nq; q0 += kQB) {
      int64_t lo[kQB], hi[kQB];
      for (int64_t i = 0; i < kQB && q0 + i < nq; ++i) {
        lo[i] = std::max(first[q0 + i], p0);
        hi[i] = std::min(pos[q0 + i], p0 + nb - 1);
      }
      switch (std::min<int64_t>(kQB, nq - q0)) {
        case 4: block_step<4>(blk, q0, p0, nb, lo, hi, m + q0, l + q0, acc); break;
        case 3: block_step<3>(blk, q0, p0, nb, lo, hi, m + q0, l + q0, acc); break;
        case 2: block_step<2>(blk, q0, p0, nb, lo, hi, m + q0, l + q0, acc); break;
        default: block_step<1>(blk, q0, p0, nb, lo, hi, m + q0, l + q0, acc); break;
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t g = qi % G;
    float inv = 1.0f / l[qi];
    if (a.sinks) {
      const float sink = a.sinks[h * G + g], m_new = std::max(m[qi], sink), alpha = std::exp(m[qi] - m_new);
      inv = alpha / (l[qi] * alpha + std::exp(sink - m_new));
    }
    float* out = a.out + ((it.t0 + qi / G) * hq + h * G + g) * D;
    for (int64_t j = 0; j < nv; ++j) store(out + 16 * j, load(acc + qi * D + 16 * j) * inv);
  }
}

// float32 products of a pool of type P and queries of type Q (widened in registers).
template <typename P, typename Q = float>
void run(const Args& a, const Item& it, int64_t h, bool local) {
  local ? attend<P, Float32Block<P, Q>, true>(a, it, h) : attend<P, Float32Block<P, Q>, false>(a, it, h);
}

}  // namespace

static ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_ids,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs, float scale, int64_t chunk,
                      int64_t window, const float* sinks, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(); auto kd = k_pages.dimensions(); auto td = page_table.dimensions();
  auto vd = v_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || vd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("paged_attention: q [T, Hq, D], pools [L, N, ps, Hkv, D], page_table [S, P]");
  const int64_t T = qd[0], hq = qd[1], D = qd[2], hkv = kd[3];
  if (kd[4] != D || D % 16 != 0 || D > kMaxDim || hkv < 1 || hq % hkv != 0 || hq / hkv > kMaxGroup ||
      positions.dimensions()[0] != T || seq_ids.dimensions()[0] != T || td[1] < 1)
    return ffi::Error::InvalidArgument("paged_attention: head_dim a multiple of 16 (at most 256), at most 16 query "
                                       "heads per kv head, positions and seq_ids of [T]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("paged_attention: layer index out of range");
  const int64_t per_layer = kd[1] * kd[2] * kd[3] * kd[4];
  const int64_t G = hq / hkv;
  if (chunk < 0 || window < 0) return ffi::Error::InvalidArgument("paged_attention: chunk and window must be >= 0");
  Args a{q.untyped_data(), scale, nullptr, nullptr, positions.typed_data(), page_table.typed_data(), td[1], kd[1],
         kd[2], hkv, G, D, out->typed_data(), chunk, window, sinks};
  const ffi::DataType type = k_pages.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::U16 && type != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("paged_attention: the pool must be float32, uint16 (bfloat16 bits) or "
                                       "uint8 (float8_e4m3fn bits)");
  const bool bf16 = q.element_type() == ffi::DataType::BF16;
  if (!bf16 && q.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_attention: q must be float32 or bfloat16");
#if defined(__AVX512BF16__)
  if (bf16 && type != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("paged_attention: bfloat16 queries need a bfloat16 (uint16) pool");
#else
  if (bf16) return ffi::Error::InvalidArgument("paged_attention: bfloat16 queries need a build with AVX512-BF16");
#endif
  const size_t bytes = type == ffi::DataType::F32 ? 4 : type == ffi::DataType::U16 ? 2 : 1;
  a.k = static_cast<const char*>(k_pages.untyped_data()) + l * per_layer * bytes;
  a.v = static_cast<const char*>(v_pages.untyped_data()) + l * per_layer * bytes;
  // Items: runs of consecutive tokens of one row (a sequence's tokens are contiguous); padding tokens'
  // outputs are zeros. An item reads its row's keys once for all its tokens, so items are as long as
  // kMaxQueries allows, but short enough that the step has 4 items and kv heads a thread to share.
  const int64_t rows = std::min<int64_t>(num_seqs.typed_data()[0], td[0]);
  const int32_t* sid = seq_ids.typed_data();
  int64_t real = 0;
  std::vector<int64_t> row_tokens(std::max<int64_t>(rows, 0), 0);
  for (int64_t t = 0; t < T; ++t)
    if (sid[t] >= 0 && sid[t] < rows) ++real, ++row_tokens[sid[t]];
  const int64_t min_items = (4 * std::max<int64_t>(1, pool.num_threads()) + hkv - 1) / hkv;
  const int64_t per_item = std::max<int64_t>(1, std::min<int64_t>(kMaxQueries / G, (real + min_items - 1) / min_items));
  std::vector<Item> items;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = sid[t];
    if (row < 0 || row >= rows) { std::memset(a.out + t * hq * D, 0, hq * D * sizeof(float)); continue; }
    Item* back = items.empty() ? nullptr : &items.back();
    if (back && back->row == row && back->t0 + back->nt == t && back->nt < per_item) ++back->nt;
    else items.push_back({t, 1, row, bf16 && row_tokens[row] >= kBf16MinTokens});
  }
  const bool local = chunk > 0 || window > 0;
  // The last items of a row read the most keys: they go first, so no thread is left with one at the end.
  run_chunks(pool, int64_t(items.size()) * hkv, [&a, &items, type, local, bf16](int64_t i) {
    const Item& it = items[items.size() - 1 - i / a.hkv];
    const int64_t h = i % a.hkv;
#if defined(__AVX512BF16__)
    if (it.bf16) return local ? attend<uint16_t, Bf16Block, true>(a, it, h) : attend<uint16_t, Bf16Block, false>(a, it, h);
#endif
    if (bf16) run<uint16_t, uint16_t>(a, it, h, local);  // bfloat16 queries, widened
    else if (type == ffi::DataType::F32) run<float>(a, it, h, local);
    else if (type == ffi::DataType::U16) run<uint16_t>(a, it, h, local);
    else run<uint8_t>(a, it, h, local);
  });
  return ffi::Error::Success();
}

static ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_ids,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs, float scale,
                       ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, scale, 0, 0, nullptr, out);
}

// A local layer: its chunk and window are traced (one scanned layer body serves every kind), so buffers.
static ffi::Error ImplLocal(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> page_table,
                            ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> chunk,
                            ffi::Buffer<ffi::S32> window, float scale, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, scale, chunk.typed_data()[0],
             window.typed_data()[0], nullptr, out);
}

// Attention sinks, a layer of any kind (chunk = window = 0: global).
static ffi::Error ImplSinks(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> page_table,
                            ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> chunk, ffi::Buffer<ffi::S32> window,
                            ffi::Buffer<ffi::F32> sinks, float scale, ffi::ResultBuffer<ffi::F32> out) {
  if (sinks.dimensions().size() != 1 || q.dimensions().size() != 3 || sinks.dimensions()[0] != q.dimensions()[1])
    return ffi::Error::InvalidArgument("paged_attention: sinks must be [Hq]");
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, scale, chunk.typed_data()[0],
             window.typed_data()[0], sinks.typed_data(), out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttention, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale").Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttentionLocal, ImplLocal,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale").Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttentionSinks, ImplSinks,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Attr<float>("scale").Ret<ffi::Buffer<ffi::F32>>());
