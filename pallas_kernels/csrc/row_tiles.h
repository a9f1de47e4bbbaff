// Row tiling shared by the CPU matmul kernels (csrc/*.cc).
#pragma once
#include <cstdint>
#include <type_traits>

namespace infire {

// Row tiling: tile(std::integral_constant<int, R>, m) for tiles of MR rows from
// m = 0, then one call for the R < MR rows left, so each tile size is its own compiled loop.
template <int R, typename Tile>
static inline void tail_tile(int64_t left, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R) tile(std::integral_constant<int, R>{}, m);
    else tail_tile<R - 1>(left, m, tile);
  }
}

template <int MR, typename Tile>
static inline void row_tiles(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(std::integral_constant<int, MR>{}, m);
  tail_tile<MR - 1>(M - m, m, tile);
}

}  // namespace infire
