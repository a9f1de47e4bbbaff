// y[M, N] = x[M, K] . w[layer] for w kept as GGUF Q4_1 blocks (infire_jax/quant/gguf_blocks.py), dequantized
// in registers on the way into the float32 FMAs (pallas_kernels/cpu_matmul.py `q4_1_matmul`): a weight costs
// 5 bits of memory traffic (its nibble, and an fp16 scale and min per 32), not the 32 of the float32 layer
// the scan would otherwise write and read back.
//
// Layout, per layer, input axis first as the model keeps it: q [K / 2, N] bytes, row 16 b + e of block b
// holding input 32 b + e in its low nibble and input 32 b + 16 + e in its high one; d and m [K / 32, N]
// float16. w[k, n] = d * q + m: the fp16 values are exact in float32 and so is d * q (4 + 11 bits), so one
// FMA rounds the sum once, as the format's definition does: the weights are bitwise those of the layer-body
// dequantizer. Float32 sums, each output element's in the same order whatever M is, so a row's result does
// not depend on the other rows of the batch. Decode steps (M <= 16): a tile of 64 columns and up to 4 rows is
// summed over all of K in registers, each row of its bytes dequantized once for the tile's rows.
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "row_tiles.h"
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::row_tiles;
using infire::run_chunks;

#if defined(__AVX512F__)
namespace {

constexpr int64_t kBlockPrefetch = 2;  // blocks of rows fetched ahead

// Up to MR rows of x times G groups of 16 columns from column c, over all of K, summed in registers.
// Each block's scales are widened once, and each row of the block's bytes (16 G bytes, one cache line
// at G = 4) is dequantized once for the MR rows.
template <int MR, int G>
static inline void tile(const float* x, int64_t K, const uint8_t* q, const uint16_t* d, const uint16_t* mn, int64_t N,
                        int64_t c, float* y) {
  __m512 acc[MR][G];
  for (int m = 0; m < MR; ++m) for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(15);
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 scale[G], low[G];
    for (int g = 0; g < G; ++g) {  // fp16 -> float32, exactly
      scale[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * N + c + 16 * g)));
      low[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b * N + c + 16 * g)));
    }
    const uint8_t* rows = q + 16 * b * N + c;
    for (int e = 0; e < 16; ++e) {
      const uint8_t* row = rows + e * N;
      if (b + kBlockPrefetch < blocks) __builtin_prefetch(row + 16 * kBlockPrefetch * N);
      for (int g = 0; g < G; ++g) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));
        const __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), scale[g], low[g]);
        const __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), scale[g], low[g]);
        for (int m = 0; m < MR; ++m) {
          acc[m][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 32 * b + e]), wl, acc[m][g]);
          acc[m][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 32 * b + 16 + e]), wh, acc[m][g]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + m * N + c + 16 * g, acc[m][g]);
}

// Columns [c0, c1) (a multiple of 16 wide) for all M rows, 64 columns a tile, rows in tiles of 4.
static void span(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* d, const uint16_t* mn,
                 int64_t N, int64_t c0, int64_t c1, float* y) {
  int64_t c = c0;
  if (M > 4) {
    for (; c + 32 <= c1; c += 32)
      row_tiles<8>(M, [&](auto rows, int64_t m) { tile<rows.value, 2>(x + m * K, K, q, d, mn, N, c, y + m * N); });
  } else {
    for (; c + 64 <= c1; c += 64)
      row_tiles<4>(M, [&](auto rows, int64_t m) { tile<rows.value, 4>(x + m * K, K, q, d, mn, N, c, y + m * N); });
  }
  for (; c < c1; c += 16)
    row_tiles<4>(M, [&](auto rows, int64_t m) { tile<rows.value, 1>(x + m * K, K, q, d, mn, N, c, y + m * N); });
}

static void q4_1_matmul(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const uint8_t* q,
                        const uint16_t* d, const uint16_t* mn, int64_t N, float* y) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Column chunks: a multiple of 64 wide (the last may be narrower), about 4 per thread.
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max<int64_t>(64, (chunk + 63) / 64 * 64);
  run_chunks(pool, (N + chunk - 1) / chunk, [=](int64_t i) {
    span(x, M, K, q, d, mn, N, i * chunk, std::min(N, (i + 1) * chunk), y);
  });
}

}  // namespace
#endif

// x [M, K] float32; q [L, K / 2, N] uint8; d, m [L, K / 32, N] float16 (as uint16); layer a scalar. y [M, N].
static ffi::Error ImplQ41(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                          ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> mn, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), dd = d.dimensions(), md = mn.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || dd.size() != 3 || md.size() != 3 || xd[1] != 2 * qd[1] ||
      xd[1] % 32 || qd[2] % 16 || dd[0] != qd[0] || dd[1] != xd[1] / 32 || dd[2] != qd[2] ||
      md[0] != dd[0] || md[1] != dd[1] || md[2] != dd[2])
    return ffi::Error::InvalidArgument("q4_1_matmul: x [M, K] (K a multiple of 32), q [L, K / 2, N] (N a multiple "
                                       "of 16), d and m [L, K / 32, N]");
  const int64_t L = qd[0], M = xd[0], K = xd[1], N = qd[2];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("q4_1_matmul: layer index out of range");
#if defined(__AVX512F__)
  const auto* dp = reinterpret_cast<const uint16_t*>(d.typed_data()) + l * (K / 32) * N;
  const auto* mp = reinterpret_cast<const uint16_t*>(mn.typed_data()) + l * (K / 32) * N;
  q4_1_matmul(pool, x.typed_data(), M, K, q.typed_data() + l * (K / 2) * N, dp, mp, N, y->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("q4_1_matmul: needs a CPU with AVX-512");
#endif
}

extern "C" int InfireHasAvx512() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireQ41Matmul, ImplQ41,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

