// Paged attention on CPU, as an XLA FFI custom call (pallas_kernels/cpu_attention.py).
//
// After this step's keys and values are written into the pool (XLA's scatter, in place), token t of
// sequence row s attends to positions 0 .. positions[t] of s, read in place from layer `layer` of
// the pool [L, N, page_size, Hkv, D] through page_table[s]. One work item is a run of up to
// kMaxQueries / G consecutive tokens of one row and one kv head: each block of kKeys positions is read
// (widened to float32) and its keys transposed once for all the item's G-headed queries, so a
// query's scores are kSub vectors (no horizontal sums), folded into an online softmax (float32
// scores, sums and exp). The queries go through a block kQB at a time, sharing each key and value
// load in registers; each query's sums are its own chains, so a token's result does not depend on
// the rest of the step. Padding tokens
// (seq_ids[t] >= num_seqs) get zeros. The pool is float32, uint16 holding bfloat16 bits, or uint8
// holding float8_e4m3fn bits (both widened exactly), as pool_storage_dtype keeps it; an fp8 pool's
// scales are folded into q and the output by the caller (pallas_kernels/kv_quant.py).
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
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::run_chunks;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));
constexpr int kMaxGroup = 16;   // query heads per kv head (at most kMaxQueries)
constexpr int kMaxDim = 256;    // head_dim

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline v16 load(const uint16_t* p) {  // bfloat16 bits: the top half of a float32
  h16 h; std::memcpy(&h, p, sizeof(h));
  const u16x bits = __builtin_convertvector(h, u16x) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof(v)); return v;
}
// float8_e4m3fn bits, widened through float16: e4m3's exponent (bias 7) and mantissa moved into
// float16's (bias 15) give the same value times 2^-8, subnormal codes included (they land on
// float16 subnormals, which the half -> float conversion widens exactly), so one conversion
// (vcvtph2ps: GCC 12 converts a _Float16 vector one lane at a time) and one multiply. Bit 7 is the
// sign. The pool never holds NaN (0x7f / 0xff): writes saturate to +-448.
inline v16 load(const uint8_t* p) {
  typedef uint8_t b16 __attribute__((vector_size(16)));
  b16 b; std::memcpy(&b, p, sizeof(b));
  const h16 u = __builtin_convertvector(b, h16);
  const h16 half_bits = ((u & 0x7f) << 7) | ((u & 0x80) << 8);
  v16 v;
#if defined(__AVX512F__)
  __m256i h; std::memcpy(&h, &half_bits, sizeof(h));
  const __m512 f = _mm512_cvtph_ps(h);
  std::memcpy(&v, &f, sizeof(v));
#elif defined(__F16C__)
  __m128i h[2]; std::memcpy(h, &half_bits, sizeof(h));
  const __m256 f[2] = {_mm256_cvtph_ps(h[0]), _mm256_cvtph_ps(h[1])};
  std::memcpy(&v, f, sizeof(v));
#else
  typedef _Float16 f16x __attribute__((vector_size(32)));
  f16x half; std::memcpy(&half, &half_bits, sizeof(half));
  v = __builtin_convertvector(half, v16);
#endif
  return v * 256.0f;
}
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 splat(float x) { return v16{} + x; }

inline float hsum(v16 v) {
  float s[16]; std::memcpy(s, &v, sizeof(s));
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = s[i] + s[i + 8];
  for (int i = 0; i < 4; ++i) a[i] += a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// exp(x) for x <= 0 (Cephes' expf: Cody-Waite reduction by ln 2, a degree-6 polynomial, scale by 2^n):
// about 1 ulp; x below -87 (underflow) gives 0.
inline v16 exp16(v16 x) {
  const v16 lo = splat(-87.0f);
  const i16x under = x < lo;
  x = x < lo ? lo : x;
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (x * 1.44269504088896341f + magic) - magic;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const i16x bits = (__builtin_convertvector(n, i16x) + 127) << 23;
  v16 scale; std::memcpy(&scale, &bits, sizeof(scale));
  const v16 out = y * scale;
  return under ? v16{} : out;
}

// The 16 x 16 transpose of r[0..15], in four rounds that swap off-diagonal blocks of 8, 4, 2, 1.
inline void transpose16(v16* r) {
#define INFIRE_ROUND(S, I0, I1)                                                  \
  for (int i = 0; i < 16; ++i) {                                                 \
    if (i & S) continue;                                                         \
    const v16 a = r[i], b = r[i + S];                                            \
    r[i] = __builtin_shufflevector(a, b, I0);                                    \
    r[i + S] = __builtin_shufflevector(a, b, I1);                                \
  }
#define INFIRE_L(...) __VA_ARGS__
  INFIRE_ROUND(8, INFIRE_L(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
               INFIRE_L(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  INFIRE_ROUND(4, INFIRE_L(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
               INFIRE_L(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  INFIRE_ROUND(2, INFIRE_L(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
               INFIRE_L(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  INFIRE_ROUND(1, INFIRE_L(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
               INFIRE_L(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef INFIRE_L
#undef INFIRE_ROUND
}

inline float hmax(v16 v) {
  float s[16]; std::memcpy(s, &v, sizeof(s));
  float m = s[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, s[i]);
  return m;
}

constexpr int kMaxQueries = 32;  // query heads per work item (tokens x G)
constexpr int kQB = 4;           // queries whose scores and value sums share each load (registers: kQB x kSub)
constexpr int kSub = 4;          // 16-position vectors per online-softmax block
constexpr int kKeys = 16 * kSub; // positions per block

struct Args {
  const float* q;       // [T, Hq, D], already scaled
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

struct Item { int64_t t0, nt, row; };  // tokens t0 .. t0 + nt - 1 of sequence row `row`

// Scores of QB queries (rows of q, D apart) against a block's keys (kt: [D, kKeys]), one chain of
// FMAs over d per query and vector, so a query's scores do not depend on its neighbours.
template <int QB>
inline void scores(const float* q, const float* kt, int64_t D, v16 (&s)[kQB][kSub]) {
  v16 acc[QB][kSub];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < kSub; ++c) acc[i][c] = v16{};
  for (int64_t d = 0; d < D; ++d) {
    v16 k[kSub];
    for (int c = 0; c < kSub; ++c) k[c] = load(kt + d * kKeys + 16 * c);
    for (int i = 0; i < QB; ++i) {
      const float x = q[i * D + d];
      for (int c = 0; c < kSub; ++c) acc[i][c] += x * k[c];
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < kSub; ++c) s[i][c] = acc[i][c];
}

// acc[i] = acc[i] * alpha[i] + sum over the block's first nb positions of p[i][b] * values[b], for
// QB queries and the CW vectors of dims from j0: each value vector is loaded once for the QB queries.
template <int QB, int CW>
inline void value_sums(float* acc, const float* p, const float* alpha, const float* vb, int64_t D, int64_t j0,
                       int64_t nb) {
  v16 o[QB][CW];
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < CW; ++c) o[i][c] = load(acc + i * D + 16 * (j0 + c)) * alpha[i];
  for (int64_t b = 0; b < nb; ++b) {
    v16 v[CW];
    for (int c = 0; c < CW; ++c) v[c] = load(vb + b * D + 16 * (j0 + c));
    for (int i = 0; i < QB; ++i) {
      const float w = p[i * kKeys + b];
      for (int c = 0; c < CW; ++c) o[i][c] += w * v[c];
    }
  }
  for (int i = 0; i < QB; ++i)
    for (int c = 0; c < CW; ++c) store(acc + i * D + 16 * (j0 + c), o[i][c]);
}

template <int QB>
inline void value_sums(float* acc, const float* p, const float* alpha, const float* vb, int64_t D, int64_t nb) {
  const int64_t nv = D / 16;
  int64_t j0 = 0;
  for (; j0 + 4 <= nv; j0 += 4) value_sums<QB, 4>(acc, p, alpha, vb, D, j0, nb);
  switch (nv - j0) {
    case 3: value_sums<QB, 3>(acc, p, alpha, vb, D, j0, nb); break;
    case 2: value_sums<QB, 2>(acc, p, alpha, vb, D, j0, nb); break;
    case 1: value_sums<QB, 1>(acc, p, alpha, vb, D, j0, nb); break;
    default: break;
  }
}

// The online-softmax step of QB queries q0.. of an item over the block at p0: scores, each query's
// visible lanes ([lo, hi]: at or before its token, from its first visible position; none: the block
// leaves it unchanged), its new max and sum, then the value sums.
template <int QB>
void block_step(const float* qb, const float* kt, const float* vb, int64_t D, int64_t p0, int64_t nb,
                const int64_t* lo, const int64_t* hi, float* m, float* l, float* acc) {
  v16 s[kQB][kSub];
  scores<QB>(qb, kt, D, s);
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
    for (int c = 0; c < kSub; ++c) {
      const i16x pos = lane + int32_t(p0 + 16 * c);
      s[i][c] = (pos >= int32_t(lo[i])) & (pos <= int32_t(hi[i])) ? s[i][c] : splat(-INFINITY);
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
  value_sums<QB>(acc, p, alpha, vb, D, nb);
}

// One item and kv head h: its nt x G queries against positions (its first token's first visible
// position) .. (its last token's position), in blocks of kKeys; each block's keys are read (widened to
// float32) and transposed once for all the item's queries, which go through it kQB at a time.
// kLocal false (chunk = window = 0): the loop starts at 0 and the masks compile away.
template <typename P, bool kLocal>
void attend(const Args& a, const Item& it, int64_t h) {
  const int64_t G = a.group, D = a.dim, nv = D / 16, hq = a.hkv * G, nq = it.nt * G;
  const int64_t last = a.positions[it.t0 + it.nt - 1];
  const int32_t* table = a.page_table + it.row * a.pages_per_seq;
  const P* kp = static_cast<const P*>(a.k);
  const P* vp = static_cast<const P*>(a.v);
  alignas(64) thread_local float kt[kMaxDim * kKeys];        // the block's keys, [D, kKeys]
  alignas(64) thread_local float vb[kKeys * kMaxDim];        // its values, [kKeys, D]
  alignas(64) thread_local float qs[kMaxQueries * kMaxDim];  // the item's queries, [nq, D]
  alignas(64) thread_local float acc[kMaxQueries * kMaxDim];
  float m[kMaxQueries], l[kMaxQueries];
  int64_t first[kMaxQueries], pos[kMaxQueries];  // each query's first visible position and its own
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t t = it.t0 + qi / G;
    pos[qi] = a.positions[t];
    first[qi] = kLocal ? first_visible(pos[qi], a.chunk, a.window) : 0;
    std::memcpy(qs + qi * D, a.q + (t * hq + h * G + qi % G) * D, D * sizeof(float));
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
    for (int sub = 0; sub < kSub; ++sub) {
      v16 rows[kMaxDim / 16][16];
      for (int64_t b = 0; b < 16; ++b) {
        const int64_t key = 16 * sub + b;
        if (key >= nb) { for (int64_t j = 0; j < nv; ++j) rows[j][b] = v16{}; continue; }
        const int64_t offset = row_offset(p0 + key);
        for (int64_t j = 0; j < nv; ++j) {
          rows[j][b] = load(kp + offset + 16 * j);
          store(vb + key * D + 16 * j, load(vp + offset + 16 * j));
        }
      }
      for (int64_t j = 0; j < nv; ++j) {
        transpose16(rows[j]);
        for (int c = 0; c < 16; ++c) store(kt + (16 * j + c) * kKeys + 16 * sub, rows[j][c]);
      }
    }
    for (int64_t q0 = 0; q0 < nq; q0 += kQB) {
      int64_t lo[kQB], hi[kQB];
      for (int64_t i = 0; i < kQB && q0 + i < nq; ++i) {
        lo[i] = std::max(first[q0 + i], p0);
        hi[i] = std::min(pos[q0 + i], p0 + nb - 1);
      }
      const float* qb = qs + q0 * D;
      float* ab = acc + q0 * D;
      switch (std::min<int64_t>(kQB, nq - q0)) {
        case 4: block_step<4>(qb, kt, vb, D, p0, nb, lo, hi, m + q0, l + q0, ab); break;
        case 3: block_step<3>(qb, kt, vb, D, p0, nb, lo, hi, m + q0, l + q0, ab); break;
        case 2: block_step<2>(qb, kt, vb, D, p0, nb, lo, hi, m + q0, l + q0, ab); break;
        default: block_step<1>(qb, kt, vb, D, p0, nb, lo, hi, m + q0, l + q0, ab); break;
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

}  // namespace

static ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_ids,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs, int64_t chunk, int64_t window,
                      const float* sinks, ffi::ResultBuffer<ffi::F32> out) {
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
  Args a{q.typed_data(), nullptr, nullptr, positions.typed_data(), page_table.typed_data(), td[1], kd[1], kd[2], hkv,
         G, D, out->typed_data(), chunk, window, sinks};
  const ffi::DataType type = k_pages.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::U16 && type != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("paged_attention: the pool must be float32, uint16 (bfloat16 bits) or "
                                       "uint8 (float8_e4m3fn bits)");
  const size_t bytes = type == ffi::DataType::F32 ? 4 : type == ffi::DataType::U16 ? 2 : 1;
  a.k = static_cast<const char*>(k_pages.untyped_data()) + l * per_layer * bytes;
  a.v = static_cast<const char*>(v_pages.untyped_data()) + l * per_layer * bytes;
  // Items: runs of consecutive tokens of one row (a sequence's tokens are contiguous), at most
  // kMaxQueries / G tokens each; padding tokens' outputs are zeros.
  const int64_t rows = std::min<int64_t>(num_seqs.typed_data()[0], td[0]);
  const int64_t per_item = std::max<int64_t>(1, kMaxQueries / G);
  const int32_t* sid = seq_ids.typed_data();
  std::vector<Item> items;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = sid[t];
    if (row < 0 || row >= rows) { std::memset(a.out + t * hq * D, 0, hq * D * sizeof(float)); continue; }
    Item* back = items.empty() ? nullptr : &items.back();
    if (back && back->row == row && back->t0 + back->nt == t && back->nt < per_item) ++back->nt;
    else items.push_back({t, 1, row});
  }
  const bool local = chunk > 0 || window > 0;
  run_chunks(pool, int64_t(items.size()) * hkv, [&a, &items, type, local](int64_t i) {
    const Item& it = items[i / a.hkv];
    const int64_t h = i % a.hkv;
    if (type == ffi::DataType::F32) local ? attend<float, true>(a, it, h) : attend<float, false>(a, it, h);
    else if (type == ffi::DataType::U16) local ? attend<uint16_t, true>(a, it, h) : attend<uint16_t, false>(a, it, h);
    else local ? attend<uint8_t, true>(a, it, h) : attend<uint8_t, false>(a, it, h);
  });
  return ffi::Error::Success();
}

static ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_ids,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs,
                       ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, 0, 0, nullptr, out);
}

// A local layer: its chunk and window are traced (one scanned layer body serves every kind), so buffers.
static ffi::Error ImplLocal(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> page_table,
                            ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> chunk,
                            ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, chunk.typed_data()[0],
             window.typed_data()[0], nullptr, out);
}

// Attention sinks, a layer of any kind (chunk = window = 0: global).
static ffi::Error ImplSinks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                            ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> seq_ids, ffi::Buffer<ffi::S32> page_table,
                            ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> chunk, ffi::Buffer<ffi::S32> window,
                            ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out) {
  if (sinks.dimensions().size() != 1 || q.dimensions().size() != 3 || sinks.dimensions()[0] != q.dimensions()[1])
    return ffi::Error::InvalidArgument("paged_attention: sinks must be [Hq]");
  return Run(pool, q, k_pages, v_pages, layer, positions, seq_ids, page_table, num_seqs, chunk.typed_data()[0],
             window.typed_data()[0], sinks.typed_data(), out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttention, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttentionLocal, ImplLocal,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttentionSinks, ImplSinks,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
