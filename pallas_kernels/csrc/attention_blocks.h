// The blocks of keys and values the CPU paged attention (csrc/paged_attention.cc) multiplies, and the
// 16-float vector helpers they share.
//
// A work item's queries go through its row's positions kKeys at a time; each block is read from the
// pool once and laid out for the products of all the item's queries:
// - Float32Block<P>: the keys widened to float32 and transposed ([D, kKeys]), so a query's scores are
//   kSub vectors (no horizontal sums); the values widened ([kKeys, D]).
// - Bf16Block (AVX512-BF16): bfloat16 products (`vdpbf16ps`, float32 sums) for bfloat16 queries over a
//   bfloat16 pool, the keys and values kept in pairs of bfloat16.
// Both give scores(q0) for kQB queries at a time (each key vector loaded once for them, one chain of
// sums per query and vector, so a query's result does not depend on its neighbours) and value_sums.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace infire {
namespace attention {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));
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

// The 16 x 16 transpose of r[0..15] (16 lanes of 32 bits), in four rounds that swap off-diagonal
// blocks of 8, 4, 2, 1.
template <typename V>
inline void transpose16(V* r) {
#define INFIRE_ROUND(S, I0, I1)                                                  \
  for (int i = 0; i < 16; ++i) {                                                 \
    if (i & S) continue;                                                         \
    const V a = r[i], b = r[i + S];                                              \
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

// The max of v's lanes: halves folded onto each other (max is exact in any order).
inline float hmax(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10, 11,
                                                                                                   12, 13, 14, 15);
  const v8 h = a > b ? a : b;
  const v4 c = __builtin_shufflevector(h, h, 0, 1, 2, 3), d = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const v4 q = c > d ? c : d;
  return std::max(std::max(q[0], q[1]), std::max(q[2], q[3]));
}

constexpr int kMaxQueries = 128;  // query heads per work item (tokens x G)
constexpr int kQB = 4;           // queries whose scores and value sums share each load (registers: kQB x kSub)
constexpr int kSub = 4;          // 16-position vectors per online-softmax block
constexpr int kKeys = 16 * kSub; // positions per block

// A block of kKeys positions for float32 products: the keys widened and transposed ([D, kKeys]), so a
// query's scores are kSub vectors, and the values widened ([kKeys, D]); the item's queries widened
// (Q: float, or uint16_t holding bfloat16 bits) and scaled.
template <typename P, typename Q = float>
struct Float32Block {
  using Query = Q;  // what the call's q holds
  alignas(64) float kt[kMaxDim * kKeys];
  alignas(64) float vb[kKeys * kMaxDim];
  alignas(64) float q[kMaxQueries * kMaxDim];
  int64_t D;

  // Query qi of the item: `src`, a [D] row of q, times the scores' scale.
  void set_query(int64_t qi, const void* src, float scale) {
    const Q* x = static_cast<const Q*>(src);
    for (int64_t d = 0; d < D; ++d) {
      float f;
      if constexpr (std::is_same_v<Q, float>) {
        f = x[d];
      } else {
        const uint32_t bits = uint32_t(x[d]) << 16;
        std::memcpy(&f, &bits, sizeof(f));
      }
      q[qi * D + d] = f * scale;
    }
  }

  // rows(b): position b's pool offset (b < nb); positions from nb on are zeros.
  template <typename Rows>
  void fill(const P* kp, const P* vp, int64_t nb, Rows rows) {
    const int64_t nv = D / 16;
    for (int sub = 0; sub < kSub; ++sub) {
      v16 r[kMaxDim / 16][16];
      for (int64_t b = 0; b < 16; ++b) {
        const int64_t key = 16 * sub + b;
        if (key >= nb) { for (int64_t j = 0; j < nv; ++j) r[j][b] = v16{}; continue; }
        const int64_t offset = rows(key);
        for (int64_t j = 0; j < nv; ++j) {
          r[j][b] = load(kp + offset + 16 * j);
          store(vb + key * D + 16 * j, load(vp + offset + 16 * j));
        }
      }
      for (int64_t j = 0; j < nv; ++j) {
        transpose16(r[j]);
        for (int c = 0; c < 16; ++c) store(kt + (16 * j + c) * kKeys + 16 * sub, r[j][c]);
      }
    }
  }

  // Scores of queries q0 .. q0 + QB - 1: one chain of FMAs over d per query and vector, so a query's
  // scores do not depend on its neighbours.
  template <int QB>
  void scores(int64_t q0, v16 (&s)[kQB][kSub]) const {
    v16 acc[QB][kSub];
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < kSub; ++c) acc[i][c] = v16{};
    const float* qb = q + q0 * D;
    for (int64_t d = 0; d < D; ++d) {
      v16 k[kSub];
      for (int c = 0; c < kSub; ++c) k[c] = load(kt + d * kKeys + 16 * c);
      for (int i = 0; i < QB; ++i) {
        const float x = qb[i * D + d];
        for (int c = 0; c < kSub; ++c) acc[i][c] += x * k[c];
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < kSub; ++c) s[i][c] = acc[i][c];
  }

  // acc[i] = acc[i] * alpha[i] + sum over the first nb positions of p[i][b] * values[b], for QB queries
  // and the CW vectors of dims from j0: each value vector is loaded once for the QB queries.
  template <int QB, int CW>
  void value_sums(float* acc, const float* p, const float* alpha, int64_t j0, int64_t nb) const {
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
};

#if defined(__AVX512BF16__)
// A block for bfloat16 products (`vdpbf16ps`, a bfloat16 pool and bfloat16 queries, as the Pallas
// kernels multiply them): the keys transposed into pairs of dims ([D/2, kKeys], lane = key, each 32-bit
// lane (k[d], k[d+1])), the values into pairs of positions ([kKeys/2, D], each lane (v[b][d],
// v[b+1][d])); the scores are scaled after the products, and the weights rounded to bfloat16 for the
// value sums (their float32 sum normalises).
struct Bf16Block {
  using Query = uint16_t;
  alignas(64) uint32_t kt[kMaxDim / 2 * kKeys];
  alignas(64) uint32_t vb[kKeys / 2 * kMaxDim];
  alignas(64) uint16_t q[kMaxQueries * kMaxDim];
  int64_t D;
  float scale;

  // Query qi of the item: `src`, a [D] row of bfloat16 bits; the scale applies to its scores.
  void set_query(int64_t qi, const void* src, float s) {
    std::memcpy(q + qi * D, src, D * sizeof(uint16_t));
    scale = s;
  }

  template <typename Rows>
  void fill(const uint16_t* kp, const uint16_t* vp, int64_t nb, Rows rows) {
    const int64_t pairs = D / 2;
    for (int sub = 0; sub < kSub; ++sub) {
      for (int64_t j = 0; 16 * j < pairs; ++j) {  // 16 pairs (32 dims) of 16 keys
        const __mmask16 lanes = __mmask16((1u << std::min<int64_t>(16, pairs - 16 * j)) - 1);
        i16x r[16];
        for (int64_t b = 0; b < 16; ++b) {
          const int64_t key = 16 * sub + b;
          const __m512i x = key < nb ? _mm512_maskz_loadu_epi32(lanes, kp + rows(key) + 32 * j) : __m512i{};
          std::memcpy(&r[b], &x, sizeof(x));
        }
        transpose16(r);
        for (int64_t c = 0; c < 16 && 16 * j + c < pairs; ++c)
          std::memcpy(kt + (16 * j + c) * kKeys + 16 * sub, &r[c], sizeof(r[c]));
      }
    }
    for (int64_t b = 0; b < kKeys; b += 2) {
      const uint16_t* even = b < nb ? vp + rows(b) : nullptr;
      const uint16_t* odd = b + 1 < nb ? vp + rows(b + 1) : nullptr;
      for (int64_t j = 0; j < D; j += 16) {
        const __m512i lo = even ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + j))) : __m512i{};
        const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(odd + j))) : __m512i{};
        _mm512_store_si512(vb + b / 2 * D + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }

  template <int QB>
  void scores(int64_t q0, v16 (&s)[kQB][kSub]) const {
    __m512 acc[QB][kSub];
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < kSub; ++c) acc[i][c] = _mm512_setzero_ps();
    const uint16_t* qb = q + q0 * D;
    for (int64_t d = 0; d < D / 2; ++d) {
      __m512bh k[kSub];
      for (int c = 0; c < kSub; ++c) k[c] = (__m512bh)_mm512_load_si512(kt + d * kKeys + 16 * c);
      for (int i = 0; i < QB; ++i) {
        uint32_t pair;
        std::memcpy(&pair, qb + i * D + 2 * d, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(pair));
        for (int c = 0; c < kSub; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], x, k[c]);
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < kSub; ++c) s[i][c] = (v16)acc[i][c] * scale;
  }

  template <int QB, int CW>
  void value_sums(float* acc, const float* p, const float* alpha, int64_t j0, int64_t nb) const {
    alignas(64) uint32_t w[QB][kKeys / 2];  // each query's weights, rounded, in pairs of positions
    for (int i = 0; i < QB; ++i)
      for (int b = 0; b < kKeys; b += 32) {
        const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_load_ps(p + i * kKeys + b + 16), _mm512_load_ps(p + i * kKeys + b));
        std::memcpy(&w[i][b / 2], &x, sizeof(x));
      }
    __m512 o[QB][CW];
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < CW; ++c)
        o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * (j0 + c)), _mm512_set1_ps(alpha[i]));
    for (int64_t b = 0; 2 * b < nb; ++b) {
      __m512bh v[CW];
      for (int c = 0; c < CW; ++c) v[c] = (__m512bh)_mm512_load_si512(vb + b * D + 16 * (j0 + c));
      for (int i = 0; i < QB; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(w[i][b]));
        for (int c = 0; c < CW; ++c) o[i][c] = _mm512_dpbf16_ps(o[i][c], x, v[c]);
      }
    }
    for (int i = 0; i < QB; ++i)
      for (int c = 0; c < CW; ++c) _mm512_storeu_ps(acc + i * D + 16 * (j0 + c), o[i][c]);
  }
};
#endif

}  // namespace attention
}  // namespace infire
