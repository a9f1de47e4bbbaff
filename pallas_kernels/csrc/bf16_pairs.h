// The inner step of the bfloat16 panel matmuls (csrc/skinny_matmul.cc, csrc/palette_matmul.cc).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace infire {

// acc[m][2 g] += x[m, k:k+2] . a[g] and acc[m][2 g + 1] += x[m, k:k+2] . b[g] for MR rows of x and G
// panels: each lane of a[g] and b[g] is the pair (w[k, n], w[k + 1, n]) that `vdpbf16ps` takes.
template <int MR, int G>
static inline void dot_pairs(__m512 (&acc)[MR][2 * G], const uint16_t* x, int64_t K, int64_t k,
                             const __m512i (&a)[G], const __m512i (&b)[G]) {
  for (int m = 0; m < MR; ++m) {
    int32_t pair;
    std::memcpy(&pair, x + m * K + k, sizeof(pair));
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
    for (int g = 0; g < G; ++g) {
      acc[m][2 * g] = _mm512_dpbf16_ps(acc[m][2 * g], xv, (__m512bh)a[g]);
      acc[m][2 * g + 1] = _mm512_dpbf16_ps(acc[m][2 * g + 1], xv, (__m512bh)b[g]);
    }
  }
}

}  // namespace infire
#endif
