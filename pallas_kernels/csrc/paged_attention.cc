// Paged attention of CPU decode steps, as an XLA FFI custom call (pallas_kernels/cpu_attention.py).
//
// After this step's keys and values are written into the pool (XLA's scatter, in place), token t of
// sequence row s attends to positions 0 .. positions[t] of s, read in place from layer `layer` of
// the pool [L, N, page_size, Hkv, D] through page_table[s]: one work item per (token, kv head), its
// G query heads sharing each key and value row. Blocks of 16 positions are folded into an online
// softmax (float32 scores, sums and exp). Padding tokens (seq_ids[t] >= num_seqs) get zeros. The
// pool is float32, or uint16 holding bfloat16 bits (widened exactly), as pool_storage_dtype keeps it.
//
// The reference attention (pallas_kernels/reference.py) gathers each row's pages into new arrays
// every layer and runs its small ops one after another; here nothing is copied.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::run_chunks;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));
constexpr int kBlock = 16;      // positions per online-softmax block
constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxDim = 256;    // head_dim

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline v16 load(const uint16_t* p) {  // bfloat16 bits: the top half of a float32
  h16 h; std::memcpy(&h, p, sizeof(h));
  const u16x bits = __builtin_convertvector(h, u16x) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof(v)); return v;
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

struct Args {
  const float* q;       // [T, Hq, D], already scaled
  const void* k;        // layer `layer` of the pool: [N, ps, Hkv, D]
  const void* v;
  const int32_t* positions;
  const int32_t* seq_ids;
  const int32_t* page_table;  // [S, P]
  int64_t num_seqs, pages_per_seq, num_pages, page_size, hkv, group, dim;
  float* out;           // [T, Hq, D]
};

// Token t, kv head h: its G query heads against positions 0 .. positions[t] of its row.
template <typename P>
void attend(const Args& a, int64_t t, int64_t h) {
  const int64_t G = a.group, D = a.dim, nv = D / 16, hq = a.hkv * G;
  float* out = a.out + (t * hq + h * G) * D;
  const int64_t row = a.seq_ids[t];
  if (row < 0 || row >= a.num_seqs) { std::memset(out, 0, G * D * sizeof(float)); return; }
  const int64_t n = int64_t(a.positions[t]) + 1;
  const int32_t* table = a.page_table + row * a.pages_per_seq;
  const P* kp = static_cast<const P*>(a.k);
  const P* vp = static_cast<const P*>(a.v);
  const int64_t row_stride = a.hkv * D;  // between positions of one page

  v16 q[kMaxGroup][kMaxDim / 16], acc[kMaxGroup][kMaxDim / 16];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < nv; ++j) { q[g][j] = load(a.q + (t * hq + h * G + g) * D + 16 * j); acc[g][j] = v16{}; }
    m[g] = -INFINITY; l[g] = 0.0f;
  }
  for (int64_t p0 = 0; p0 < n; p0 += kBlock) {
    const int64_t nb = std::min<int64_t>(kBlock, n - p0);
    const P* vrows[kBlock];
    alignas(64) float s[kMaxGroup][kBlock];
    for (int64_t g = 0; g < G; ++g) std::fill(&s[g][nb], &s[g][kBlock], -INFINITY);  // a short last block
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pos = p0 + b;
      const int64_t page = std::clamp<int64_t>(table[std::min(pos / a.page_size, a.pages_per_seq - 1)], 0,
                                               a.num_pages - 1);
      const int64_t offset = ((page * a.page_size + pos % a.page_size) * a.hkv + h) * D;
      const P* krow = kp + offset;
      vrows[b] = vp + offset;
      v16 kv[kMaxDim / 16];
      for (int64_t j = 0; j < nv; ++j) kv[j] = load(krow + 16 * j);
      for (int64_t g = 0; g < G; ++g) {
        v16 d = q[g][0] * kv[0];
        for (int64_t j = 1; j < nv; ++j) d += q[g][j] * kv[j];
        s[g][b] = hsum(d);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float mb = s[g][0];
      for (int64_t b = 1; b < nb; ++b) mb = std::max(mb, s[g][b]);
      const float m_new = std::max(m[g], mb);
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first block (m = -inf)
      v16 sv = load(&s[g][0]) - m_new;
      alignas(64) float p[kBlock];
      store(p, exp16(sv));
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) sum += p[b];
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      for (int64_t j = 0; j < nv; ++j) acc[g][j] *= alpha;
      std::memcpy(&s[g][0], p, sizeof(p));  // s now holds the block's weights
    }
    for (int64_t b = 0; b < nb; ++b) {
      v16 vv[kMaxDim / 16];
      for (int64_t j = 0; j < nv; ++j) vv[j] = load(vrows[b] + 16 * j);
      for (int64_t g = 0; g < G; ++g) {
        const float w = s[g][b];
        for (int64_t j = 0; j < nv; ++j) acc[g][j] += w * vv[j];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t j = 0; j < nv; ++j) store(out + g * D + 16 * j, acc[g][j] * inv);
  }
}

}  // namespace

static ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> seq_ids,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_seqs,
                       ffi::ResultBuffer<ffi::F32> out) {
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
  Args a{q.typed_data(), nullptr, nullptr, positions.typed_data(), seq_ids.typed_data(), page_table.typed_data(),
         std::min<int64_t>(num_seqs.typed_data()[0], td[0]), td[1], kd[1], kd[2], hkv, hq / hkv, D,
         out->typed_data()};
  const bool f32 = k_pages.element_type() == ffi::DataType::F32;
  if (!f32 && k_pages.element_type() != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("paged_attention: the pool must be float32 or uint16 (bfloat16 bits)");
  const size_t bytes = f32 ? 4 : 2;
  a.k = static_cast<const char*>(k_pages.untyped_data()) + l * per_layer * bytes;
  a.v = static_cast<const char*>(v_pages.untyped_data()) + l * per_layer * bytes;
  run_chunks(pool, T * hkv, [&a, f32](int64_t i) {
    const int64_t t = i / a.hkv, h = i % a.hkv;
    if (f32) attend<float>(a, t, h); else attend<uint16_t>(a, t, h);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePagedAttention, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
