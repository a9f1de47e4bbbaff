// The CPU matmuls of the layer weights and the LM head, as XLA FFI custom calls
// (pallas_kernels/cpu_matmul.py).
//
// y[M, N] = x[M, K] . w[layer, K, N]: layer `layer` of a stacked row-major weight, read in place (no
// copy of the slice), on XLA's own intra-op thread pool, each thread over its own column chunks.
// Float32 sums. Two kernels:
//  - float32 x (decode steps, M <= 16): weights float32 or bfloat16 (widened exactly in registers),
//    every row of w streamed once per call, the chunk's partial sums in L1, four rows of w per step;
//  - bfloat16 x and w where the CPU has AVX512-BF16 (any M: decode and prefill): `vdpbf16ps` sums
//    pairs of exact bfloat16 products into float32 accumulators held in registers over all of K.
//
// Every output element is summed in the same order whatever M is (k ascending, in fours or in
// pairs), so a row's result does not depend on the other rows of the batch.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "bf16_pairs.h"
#include "row_tiles.h"
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::row_tiles;
using infire::run_chunks;
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));
static inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
// bfloat16 is the top half of a float32: widen and shift, exactly.
static inline v16 load16(const uint16_t* p) {
  h16 h; std::memcpy(&h, p, sizeof(h));
  const u16x bits = __builtin_convertvector(h, u16x) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof(v)); return v;
}
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// Rows of w fetched ahead when MB > 1 (measured: 8 rows 17.4 -> 14.5 ms a pass; one row is faster without).
constexpr int64_t kPrefetchRows = 32;
// Steps of a panel (128 bytes each: a bfloat16 k-pair or a float32 row) fetched ahead by the panel
// matmuls: 4 KB at several rows, 1 KB at one row, whose tile reads 8 panels at once (measured on
// bfloat16: 16 and 8 steps are slower at 8-16 rows, 32 slower at one row).
template <int MR> constexpr int64_t kPanelPrefetch = MR == 1 ? 8 : 32;


// Columns [c0, c1) of y (a multiple of 16 wide) for MB rows of x, four rows of w per step.
template <int MB, typename W>
static void strip(const float* x, int64_t K, const W* w, int64_t N, int64_t c0, int64_t c1, float* y) {
  const int64_t nv = (c1 - c0) / 16;
  v16 acc[MB][32];  // up to 512 columns per call
  for (int m = 0; m < MB; ++m) for (int64_t j = 0; j < nv; ++j) acc[m][j] = v16{};
  for (int64_t k = 0; k < K; k += 4) {
    const W* w0 = w + k * N + c0;
    const bool ahead = MB > 1 && k + kPrefetchRows + 4 <= K;
    float xs[MB][4];
    for (int m = 0; m < MB; ++m) for (int i = 0; i < 4; ++i) xs[m][i] = x[m * K + k + i];
    for (int64_t j = 0; j < nv; ++j) {
      if (ahead) {
        const W* p = w0 + kPrefetchRows * N + 16 * j;
        for (int i = 0; i < 4; ++i) __builtin_prefetch(p + i * N);
      }
      const v16 a = load16(w0 + 16 * j), b = load16(w0 + N + 16 * j), c = load16(w0 + 2 * N + 16 * j),
                d = load16(w0 + 3 * N + 16 * j);
      for (int m = 0; m < MB; ++m) acc[m][j] += xs[m][0] * a + xs[m][1] * b + xs[m][2] * c + xs[m][3] * d;
    }
  }
  for (int m = 0; m < MB; ++m) for (int64_t j = 0; j < nv; ++j) store16(y + m * N + c0 + 16 * j, acc[m][j]);
}

template <typename W>
static void run_strip(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t c0, int64_t c1, float* y) {
  row_tiles<8>(M, [&](auto rows, int64_t m) { strip<rows.value>(x + m * K, K, w, N, c0, c1, y + m * N); });
}

template <typename W>
static void run(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K, const W* wp, int64_t N, float* yp) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Column chunks: a multiple of 16 wide, at most 512, about 4 per thread.
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::min<int64_t>(512, std::max<int64_t>(16, (chunk + 15) / 16 * 16));
  run_chunks(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    run_strip(xp, M, K, wp, N, c * chunk, std::min(N, (c + 1) * chunk), yp);
  });
}

#if defined(__AVX512BF16__)
constexpr int64_t kDotPrefetchRows = 16;  // rows of w ahead (measured: 5-15% faster at 1-64 rows)

// MR rows of x times G groups of 32 columns of w (bfloat16 both), over all of K, summed in
// registers. Rows k and k + 1 of w are interleaved in registers (unpacklo/hi), so each 32-bit lane
// holds the pair (w[k, n], w[k + 1, n]) that `vdpbf16ps` multiplies with (x[m, k], x[m, k + 1]).
template <int MR, int G>
static inline void dp_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, int64_t c, float* y) {
  __m512 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m) for (int g = 0; g < 2 * G; ++g) acc[m][g] = _mm512_setzero_ps();
  const uint16_t* wp = w + c;
  for (int64_t k = 0; k < K; k += 2, wp += 2 * N) {
    if (k + kDotPrefetchRows + 2 <= K) {
      for (int g = 0; g < G; ++g) {
        __builtin_prefetch(wp + kDotPrefetchRows * N + 32 * g);
        __builtin_prefetch(wp + (kDotPrefetchRows + 1) * N + 32 * g);
      }
    }
    __m512i lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      const __m512i r0 = _mm512_loadu_si512(wp + 32 * g), r1 = _mm512_loadu_si512(wp + N + 32 * g);
      lo[g] = _mm512_unpacklo_epi16(r0, r1);
      hi[g] = _mm512_unpackhi_epi16(r0, r1);
    }
    infire::dot_pairs<MR, G>(acc, x, K, k, lo, hi);
  }
  // In each 128-bit lane, lo holds that lane's columns 0-3 and hi its columns 4-7: put them in order.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < MR; ++m) {
    for (int g = 0; g < G; ++g) {
      float* out = y + m * N + c + 32 * g;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[m][2 * g], first, acc[m][2 * g + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(acc[m][2 * g], second, acc[m][2 * g + 1]));
    }
  }
}

// All M rows for the G column groups at column c: MR-row tiles, then one tile of the rows left.
template <int MR, int G>
static void dp_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, int64_t c, float* y) {
  row_tiles<MR>(M, [&](auto rows, int64_t m) { dp_tile<rows.value, G>(x + m * K, K, w, N, c, y + m * N); });
}

// Column groups [g0, g1) of 32 for all rows, in tiles as wide as the register budget allows: 2 * MR * G
// accumulators (one row: 8 groups; up to 4 rows: 3; more rows, MR = 12: 1), narrower at the end.
template <int MR>
static void dp_span(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, int64_t g0, int64_t g1,
                    float* y) {
  constexpr int widest = MR == 1 ? 8 : MR <= 4 ? 3 : 1;
  for (int64_t g = g0; g < g1;) {
    const int64_t left = g1 - g;
    if (widest >= 8 && left >= 8) { dp_rows<MR, (widest >= 8 ? 8 : 1)>(x, M, K, w, N, 32 * g, y); g += 8; }
    else if (widest >= 4 && left >= 4) { dp_rows<MR, (widest >= 4 ? 4 : 1)>(x, M, K, w, N, 32 * g, y); g += 4; }
    else if (widest >= 3 && left >= 3) { dp_rows<MR, (widest >= 3 ? 3 : 1)>(x, M, K, w, N, 32 * g, y); g += 3; }
    else if (widest >= 2 && left >= 2) { dp_rows<MR, (widest >= 2 ? 2 : 1)>(x, M, K, w, N, 32 * g, y); g += 2; }
    else { dp_rows<MR, 1>(x, M, K, w, N, 32 * g, y); g += 1; }
  }
}

// y = x . w with bfloat16 x [M, K] and w [K, N] (N a multiple of 32): column chunks, about four per
// thread, each over all rows of x (the chunk's columns of w stay in L1/L2 while the rows pass).
static void dp_matmul(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                      float* y) {
  const int64_t groups = N / 32, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t cg = (groups + 4 * threads - 1) / (4 * threads);
  run_chunks(pool, (groups + cg - 1) / cg, [=](int64_t i) {
    const int64_t g0 = i * cg, g1 = std::min(groups, g0 + cg);
    if (M == 1) dp_span<1>(x, M, K, w, N, g0, g1, y);
    else if (M <= 16) dp_span<4>(x, M, K, w, N, g0, g1, y);
    else dp_span<12>(x, M, K, w, N, g0, g1, y);
  });
}

// The same product with w in the panel layout (`cpu_matmul.pack_panels`): [N / 32, K / 2, 64], panel p
// holding columns [32p, 32p + 32) as K / 2 runs of two vectors, each lane the pair (w[k, n], w[k + 1, n])
// that `vdpbf16ps` takes. A tile streams whole panels front to back, so the hardware sees a few
// sequential streams instead of a 64-byte read every N elements (cpu_matmul_bench, 8 rows: 24 -> 36 GB/s).
template <int MR, int G>
static inline void panel_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, int64_t p, float* y) {
  __m512 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m) for (int g = 0; g < 2 * G; ++g) acc[m][g] = _mm512_setzero_ps();
  const int64_t panel = K * 32;
  const uint16_t* wp = w + p * panel;
  for (int64_t k = 0; k < K; k += 2, wp += 64) {
    if (k + 2 * kPanelPrefetch<MR> < K) {
      for (int g = 0; g < G; ++g) {
        __builtin_prefetch(wp + g * panel + 64 * kPanelPrefetch<MR>);
        __builtin_prefetch(wp + g * panel + 64 * kPanelPrefetch<MR> + 32);
      }
    }
    __m512i a[G], b[G];
    for (int g = 0; g < G; ++g) {
      a[g] = _mm512_loadu_si512(wp + g * panel);
      b[g] = _mm512_loadu_si512(wp + g * panel + 32);
    }
    infire::dot_pairs<MR, G>(acc, x, K, k, a, b);
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 2 * G; ++g) _mm512_storeu_ps(y + m * N + 32 * p + 16 * g, acc[m][g]);
}

#endif

// float32 panels [N / 32, K, 32]: panel p holds columns [32p, 32p + 32), row k of it 32 contiguous
// floats. MR rows by G panels summed over all of K in registers, one FMA per weight and row, k ascending
// (the same order whatever M is), the next rows of each panel prefetched as in the bfloat16 tile.
template <int MR, int G>
static inline void panel_tile(const float* x, int64_t K, const float* w, int64_t N, int64_t p, float* y) {
  v16 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m) for (int g = 0; g < 2 * G; ++g) acc[m][g] = v16{};
  const int64_t panel = K * 32;
  const float* wp = w + p * panel;
  for (int64_t k = 0; k < K; ++k, wp += 32) {
    if (k + kPanelPrefetch<MR> < K) {
      for (int g = 0; g < G; ++g) {
        __builtin_prefetch(wp + g * panel + 32 * kPanelPrefetch<MR>);
        __builtin_prefetch(wp + g * panel + 32 * kPanelPrefetch<MR> + 16);
      }
    }
    v16 a[G], b[G];
    for (int g = 0; g < G; ++g) { a[g] = load16(wp + g * panel); b[g] = load16(wp + g * panel + 16); }
    for (int m = 0; m < MR; ++m) {
      const float xs = x[m * K + k];
      for (int g = 0; g < G; ++g) { acc[m][2 * g] += xs * a[g]; acc[m][2 * g + 1] += xs * b[g]; }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 2 * G; ++g) store16(y + m * N + 32 * p + 16 * g, acc[m][g]);
}

// Both dtypes from here on (`panel_tile` is overloaded on them). All M rows for panels [p, p + G):
// tiles of MR rows, then one tile of the rows left.
template <int MR, int G, typename T>
static void panel_rows(const T* x, int64_t M, int64_t K, const T* w, int64_t N, int64_t p, float* y) {
  row_tiles<MR>(M, [&](auto rows, int64_t m) { panel_tile<rows.value, G>(x + m * K, K, w, N, p, y + m * N); });
}

// Panels [p0, p1) for all rows: one row takes 8 panels a tile, up to 4 rows 3, more rows one panel
// in tiles of 8 rows (decode) or 12 (prompts), narrower at the end of the span.
template <int MR, int G, typename T>
static void panel_span(const T* x, int64_t M, int64_t K, const T* w, int64_t N, int64_t p0, int64_t p1,
                       float* y) {
  int64_t p = p0;
  for (; p + G <= p1; p += G) panel_rows<MR, G>(x, M, K, w, N, p, y);
  for (; p < p1; ++p) panel_rows<MR, 1>(x, M, K, w, N, p, y);
}

template <typename T>
static void panel_matmul(ffi::ThreadPool& pool, const T* x, int64_t M, int64_t K, const T* w, int64_t N,
                         float* y) {
  const int64_t panels = N / 32, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = (panels + 4 * threads - 1) / (4 * threads);
  run_chunks(pool, (panels + per - 1) / per, [=](int64_t i) {
    const int64_t p0 = i * per, p1 = std::min(panels, p0 + per);
    if (M == 1) panel_span<1, 8>(x, M, K, w, N, p0, p1, y);
    else if (M <= 4) panel_span<4, 3>(x, M, K, w, N, p0, p1, y);
    else if (M <= 16) panel_span<8, 1>(x, M, K, w, N, p0, p1, y);
    else panel_span<12, 1>(x, M, K, w, N, p0, p1, y);
  });
}

// y = x . w[layer] for panels of either dtype: bfloat16 x and panels [L, N / 32, K / 2, 64] (`vdpbf16ps`),
// or float32 x and panels [L, N / 32, K, 32].
static ffi::Error ImplPanels(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (x.element_type() != w.element_type() || (!bf16 && w.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("skinny_matmul_panels: x and panels both bfloat16 or both float32");
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != (bf16 ? 64 : 32) || xd[1] != (bf16 ? 2 : 1) * wd[2])
    return ffi::Error::InvalidArgument("skinny_matmul_panels: x [M, K], w [L, N / 32, K / 2, 64] (bfloat16) "
                                       "or [L, N / 32, K, 32] (float32)");
  const int64_t M = xd[0], K = xd[1], N = 32 * wd[1], l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("skinny_matmul_panels: layer index out of range");
  if (!bf16) {
    panel_matmul(pool, static_cast<const float*>(x.untyped_data()), M, K,
                 static_cast<const float*>(w.untyped_data()) + l * K * N, N, y->typed_data());
    return ffi::Error::Success();
  }
#if defined(__AVX512BF16__)
  panel_matmul(pool, static_cast<const uint16_t*>(x.untyped_data()), M, K,
               static_cast<const uint16_t*>(w.untyped_data()) + l * K * N, N, y->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("skinny_matmul_panels: bfloat16 panels need a CPU with AVX512-BF16");
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireSkinnyMatmulPanels, ImplPanels,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());

extern "C" int InfireHasBf16Dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

static ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("skinny_matmul: x [M, K], w [L, K, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[2], l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("skinny_matmul: layer index out of range");
  if (x.element_type() == ffi::DataType::BF16) {
#if defined(__AVX512BF16__)
    if (w.element_type() != ffi::DataType::BF16 || K % 2 != 0 || N % 32 != 0)
      return ffi::Error::InvalidArgument("skinny_matmul: bfloat16 x takes bfloat16 w with K % 2 == 0 and N % 32 == 0");
    dp_matmul(pool, static_cast<const uint16_t*>(x.untyped_data()), M, K,
              static_cast<const uint16_t*>(w.untyped_data()) + l * K * N, N, y->typed_data());
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("skinny_matmul: bfloat16 x needs a CPU with AVX512-BF16");
#endif
  }
  if (x.element_type() != ffi::DataType::F32 || N % 16 != 0 || K % 4 != 0)
    return ffi::Error::InvalidArgument("skinny_matmul: float32 x [M, K], w [L, K, N] with K % 4 == 0 and N % 16 == 0");
  const float* xp = static_cast<const float*>(x.untyped_data());
  if (w.element_type() == ffi::DataType::F32) {
    run(pool, xp, M, K, static_cast<const float*>(w.untyped_data()) + l * K * N, N, y->typed_data());
  } else if (w.element_type() == ffi::DataType::BF16) {
    run(pool, xp, M, K, static_cast<const uint16_t*>(w.untyped_data()) + l * K * N, N, y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("skinny_matmul: weights must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireSkinnyMatmul, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());

// The LM head: y[M, V] = x[M, E] . w[V, E]^T, w (the embedding layout) row-major, float32 or
// bfloat16. Each output is a dot of two contiguous rows: R rows of w against up to 4 rows of x,
// sixteen lanes summed at the end (the same order whatever M is).
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
static inline float hsum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

template <int MB, int R, typename W>
static inline void row_tile(const float* x, int64_t K, const W* w, int64_t V, int64_t n, float* y) {
  v16 acc[R][MB] = {};
  for (int64_t k = 0; k < K; k += 16) {
    v16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load16(w + (n + r) * K + k);
    for (int m = 0; m < MB; ++m) {
      const v16 xv = load16(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] += wv[r] * xv;
    }
  }
  for (int m = 0; m < MB; ++m) for (int r = 0; r < R; ++r) y[m * V + n + r] = hsum(acc[r][m]);
}

#if defined(__AVX512BF16__)
// The same with bfloat16 x and w: `vdpbf16ps` over 32 elements of both rows at a time.
template <int MB, int R>
static inline void row_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t V, int64_t n, float* y) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r) for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
    }
  }
  for (int m = 0; m < MB; ++m) for (int r = 0; r < R; ++r) y[m * V + n + r] = hsum((v16)acc[r][m]);
}
#endif

template <int MB, typename X, typename W>
static void rows_nt(const X* x, int64_t K, const W* w, int64_t V, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) row_tile<MB, 4>(x, K, w, V, n, y);
  for (; n < n1; ++n) row_tile<MB, 1>(x, K, w, V, n, y);
}

template <typename X, typename W>
static void run_nt(ffi::ThreadPool& pool, const X* x, int64_t M, int64_t K, const W* w, int64_t V, float* y) {
  const int64_t chunk = 256;  // rows of w per chunk
  run_chunks(pool, (V + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(V, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const X* xm = x + m0 * K; float* ym = y + m0 * V;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: rows_nt<1>(xm, K, w, V, n0, n1, ym); break;
        case 2: rows_nt<2>(xm, K, w, V, n0, n1, ym); break;
        case 3: rows_nt<3>(xm, K, w, V, n0, n1, ym); break;
        default: rows_nt<4>(xm, K, w, V, n0, n1, ym); break;
      }
    }
  });
}

static ffi::Error ImplNT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("skinny_matmul_nt: x [M, K], w [N, K]");
  if (x.element_type() == ffi::DataType::BF16) {
#if defined(__AVX512BF16__)
    if (w.element_type() != ffi::DataType::BF16 || xd[1] % 32 != 0)
      return ffi::Error::InvalidArgument("skinny_matmul_nt: bfloat16 x takes bfloat16 w with K % 32 == 0");
    run_nt(pool, static_cast<const uint16_t*>(x.untyped_data()), xd[0], xd[1],
           static_cast<const uint16_t*>(w.untyped_data()), wd[0], y->typed_data());
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("skinny_matmul_nt: bfloat16 x needs a CPU with AVX512-BF16");
#endif
  }
  if (x.element_type() != ffi::DataType::F32 || xd[1] % 16 != 0)
    return ffi::Error::InvalidArgument("skinny_matmul_nt: float32 x [M, K] with K % 16 == 0");
  const float* xp = static_cast<const float*>(x.untyped_data());
  if (w.element_type() == ffi::DataType::F32) {
    run_nt(pool, xp, xd[0], xd[1], static_cast<const float*>(w.untyped_data()), wd[0], y->typed_data());
  } else if (w.element_type() == ffi::DataType::BF16) {
    run_nt(pool, xp, xd[0], xd[1], static_cast<const uint16_t*>(w.untyped_data()), wd[0], y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("skinny_matmul_nt: weights must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireSkinnyMatmulNT, ImplNT,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());
