// y[M, N] = x[M, K] . w[layer] with w kept palette-compressed (lossless bfloat16, issue 10) in the
// bfloat16 panel layout of `cpu_matmul.pack_panels`, decoded in registers just before `vdpbf16ps`
// (pallas_kernels/cpu_matmul.py `palette_matmul`). A weight costs 12 bits of memory traffic, not 16.
//
// Per layer, panel p (columns [32p, 32p + 32)) is R = K / 2 runs of 64 entries, entry e of run j the
// bfloat16 w[2j + e % 2, 32p + 16 (e / 32) + (e / 2) % 16]. A run's entries are stored in the order
// `cpu_matmul.PALETTE_ORDER`: byte 16 q + r of a run (q < 4) holds entry 8 q + r for r < 8, and entry
// 32 + 8 q + r - 8 for r >= 8. Each entry is stored as
//  - its exponent's 4-bit index into the layer's palette of 16 exponents, two a byte (the entry stored
//    at 2i in the low nibble of byte i, at 2i + 1 in the high one): codes [L, P, R, 32];
//  - its sign and mantissa byte (sign << 7 | mantissa): sm [L, P, R, 64];
//  - escapes: the runs holding an exponent outside the palette, per (layer, panel) ascending run
//    numbers padded with R (esc_rows [L, P, C]) and their 64 exponents verbatim (esc_exp [L, P, C, 64]).
//
// Decoding is exact, and the products and their order (k ascending, in pairs, in float32) are those
// of the bfloat16 panel kernel (skinny_matmul.cc), so y is bitwise what the uncompressed weights give.
// Decode steps (M <= 16) decode each run in registers once per row tile; prompts decode each panel
// once into a thread-local buffer that the row tiles then read.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
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

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kRunPrefetch = 16;  // runs of each panel fetched ahead

// One layer of a palette-panel weight.
struct PaletteLayer {
  const uint8_t* codes;     // [P, R, 32]
  const uint8_t* sm;        // [P, R, 64]
  const int32_t* esc_rows;  // [P, C]
  const uint8_t* esc_exp;   // [P, C, 64]
  int64_t R, C;
  __m512i palette;  // the 16 exponents in each 128-bit lane, for `vpshufb`
};

// Run `run` of a panel as two vectors of 32 bfloat16 (entries 0-31, 32-63); `escaped` holds its
// 64 exponents when the run is an escape, else null. The bytes are stored in the order that
// interleaving them per 128-bit lane (vpunpck{l,h}bw) puts back in entry order (see the top).
static inline void decode_run(const uint8_t* codes, const uint8_t* sm, const uint8_t* escaped, __m512i palette,
                              __m512i& a, __m512i& b) {
  __m512i exponent;
  if (__builtin_expect(escaped != nullptr, 0)) {
    exponent = _mm512_loadu_si512(escaped);
  } else {
    // byte i -> 16-bit lane i = (low nibble, high nibble) as two bytes: (c | c << 4) & 0x0F0F
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i index = _mm512_ternarylogic_epi32(c, _mm512_slli_epi16(c, 4), _mm512_set1_epi16(0x0F0F), 0xA8);
    exponent = _mm512_shuffle_epi8(palette, index);
  }
  // Each entry's high byte is sign | exponent >> 1, its low byte (exponent & 1) << 7 | mantissa: bit 7
  // of each byte from one source, bits 0-6 from the other (vpternlog 0xCA: mask ? b : c, bit by bit).
  const __m512i s = _mm512_loadu_si512(sm), bit7 = _mm512_set1_epi16(static_cast<short>(0x8080));
  const __m512i high = _mm512_ternarylogic_epi32(bit7, s, _mm512_srli_epi16(exponent, 1), 0xCA);
  const __m512i low = _mm512_ternarylogic_epi32(bit7, _mm512_slli_epi16(exponent, 7), s, 0xCA);
  a = _mm512_unpacklo_epi8(low, high);
  b = _mm512_unpackhi_epi8(low, high);
}

// Panels [p, p + G) decoded run by run, each panel's escape list walked alongside.
template <int G>
struct DecodedPanels {
  const PaletteLayer& w;
  const uint8_t* codes[G];
  const uint8_t* sm[G];
  const int32_t* esc_rows[G];
  const uint8_t* esc_exp[G];
  int64_t esc[G];  // the next escape of each panel's list

  DecodedPanels(const PaletteLayer& layer, int64_t p) : w(layer) {
    for (int g = 0; g < G; ++g) {
      codes[g] = w.codes + (p + g) * w.R * 32;
      sm[g] = w.sm + (p + g) * w.R * 64;
      esc_rows[g] = w.esc_rows + (p + g) * w.C;
      esc_exp[g] = w.esc_exp + (p + g) * w.C * 64;
      esc[g] = 0;
    }
  }

  inline void run(int64_t j, __m512i (&a)[G], __m512i (&b)[G]) {
    for (int g = 0; g < G; ++g) {
      if (j + kRunPrefetch < w.R) {
        __builtin_prefetch(codes[g] + (j + kRunPrefetch) * 32);
        __builtin_prefetch(sm[g] + (j + kRunPrefetch) * 64);
      }
      const uint8_t* escaped = nullptr;
      if (esc[g] < w.C && esc_rows[g][esc[g]] == j) escaped = esc_exp[g] + 64 * esc[g]++;
      decode_run(codes[g] + j * 32, sm[g] + j * 64, escaped, w.palette, a[g], b[g]);
    }
  }
};

// One panel already decoded into bfloat16 runs [R, 64].
struct PlainPanel {
  const uint16_t* w;
  inline void run(int64_t j, __m512i (&a)[1], __m512i (&b)[1]) {
    a[0] = _mm512_loadu_si512(w + 64 * j);
    b[0] = _mm512_loadu_si512(w + 64 * j + 32);
  }
};

// MR rows of x times the G panels of `src` from panel p, summed over all of K in registers.
template <int MR, int G, typename Source>
static inline void tile(const uint16_t* x, int64_t K, Source src, int64_t N, int64_t p, float* y) {
  __m512 acc[MR][2 * G];
  for (int m = 0; m < MR; ++m) for (int g = 0; g < 2 * G; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512i a[G], b[G];
    src.run(j, a, b);
    infire::dot_pairs<MR, G>(acc, x, K, 2 * j, a, b);
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < 2 * G; ++g) _mm512_storeu_ps(y + m * N + 32 * p + 16 * g, acc[m][g]);
}

// Decode steps: panels [p0, p1) for all M rows, G panels a tile, decoded once per row tile.
template <int MR, int G>
static void decoded_span(const uint16_t* x, int64_t M, int64_t K, const PaletteLayer& w, int64_t N, int64_t p0,
                         int64_t p1, float* y) {
  int64_t p = p0;
  for (; p + G <= p1; p += G)
    row_tiles<MR>(M, [&](auto rows, int64_t m) {
      tile<rows.value, G>(x + m * K, K, DecodedPanels<G>(w, p), N, p, y + m * N);
    });
  for (; p < p1; ++p)
    row_tiles<MR>(M, [&](auto rows, int64_t m) {
      tile<rows.value, 1>(x + m * K, K, DecodedPanels<1>(w, p), N, p, y + m * N);
    });
}

// Prompts: each panel of [p0, p1) decoded once into `buffer`, then all M rows in tiles of 12.
static void buffered_span(const uint16_t* x, int64_t M, int64_t K, const PaletteLayer& w, int64_t N, int64_t p0,
                          int64_t p1, float* y) {
  thread_local std::vector<uint16_t> buffer;
  buffer.resize(w.R * 64);
  for (int64_t p = p0; p < p1; ++p) {
    DecodedPanels<1> src(w, p);
    for (int64_t j = 0; j < w.R; ++j) {
      __m512i a[1], b[1];
      src.run(j, a, b);
      _mm512_storeu_si512(buffer.data() + 64 * j, a[0]);
      _mm512_storeu_si512(buffer.data() + 64 * j + 32, b[0]);
    }
    row_tiles<12>(M, [&](auto rows, int64_t m) {
      tile<rows.value, 1>(x + m * K, K, PlainPanel{buffer.data()}, N, p, y + m * N);
    });
  }
}

static void palette_matmul(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K, const PaletteLayer& w,
                           int64_t N, float* y) {
  const int64_t panels = N / 32, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = (panels + 4 * threads - 1) / (4 * threads);
  run_chunks(pool, (panels + per - 1) / per, [=, &w](int64_t i) {
    const int64_t p0 = i * per, p1 = std::min(panels, p0 + per);
    if (M == 1) decoded_span<1, 4>(x, M, K, w, N, p0, p1, y);
    else if (M <= 4) decoded_span<4, 2>(x, M, K, w, N, p0, p1, y);
    else if (M <= 16) decoded_span<8, 1>(x, M, K, w, N, p0, p1, y);
    else buffered_span(x, M, K, w, N, p0, p1, y);
  });
}

}  // namespace
#endif

// x [M, K] bfloat16; codes [L, P, K / 2, 32], sm [L, P, K / 2, 64], palette [L, 16] uint8; esc_rows
// [L, P, ..., C] int32; esc_exp [L, P, ..., C, 64] uint8; layer a scalar. y [M, 32 P] float32.
static ffi::Error ImplPalette(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> codes,
                              ffi::Buffer<ffi::U8> sm, ffi::Buffer<ffi::U8> palette, ffi::Buffer<ffi::S32> esc_rows,
                              ffi::Buffer<ffi::U8> esc_exp, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = sm.dimensions(), pd = palette.dimensions();
  if (xd.size() != 2 || cd.size() != 4 || cd[3] != 32 || sd.size() != 4 || sd[0] != cd[0] || sd[1] != cd[1] ||
      sd[2] != cd[2] || sd[3] != 64 || xd[1] != 2 * cd[2] || pd.size() != 2 || pd[0] != cd[0] || pd[1] != 16)
    return ffi::Error::InvalidArgument("palette_matmul: x [M, K], codes [L, P, K / 2, 32], sm [L, P, K / 2, 64], "
                                       "palette [L, 16]");
  const int64_t L = cd[0], P = cd[1], R = cd[2], M = xd[0], K = xd[1], N = 32 * P;
  const int64_t C = esc_rows.element_count() / std::max<int64_t>(1, L * P);
  if (C < 1 || esc_rows.element_count() != L * P * C || esc_exp.element_count() != 64 * L * P * C)
    return ffi::Error::InvalidArgument("palette_matmul: esc_rows [L, P, C] and esc_exp [L, P, C, 64]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("palette_matmul: layer index out of range");
#if defined(__AVX512BF16__)
  PaletteLayer w{codes.typed_data() + l * P * R * 32, sm.typed_data() + l * P * R * 64,
                 esc_rows.typed_data() + l * P * C, esc_exp.typed_data() + l * P * C * 64, R, C,
                 _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(palette.typed_data() + 16 * l)))};
  palette_matmul(pool, reinterpret_cast<const uint16_t*>(x.typed_data()), M, K, w, N, y->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("palette_matmul: needs a CPU with AVX512-BF16");
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfirePaletteMatmul, ImplPalette,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
