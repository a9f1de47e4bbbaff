// The LoRA deltas of a step's tokens, each token with its own adapter slot, as an XLA FFI custom
// call (pallas_kernels/cpu_lora.py): Punica's SGMV on the CPU.
//
// y[t, n] = sum_j u[t, member(n) * R + j] * b[layer, s, j, n],  u[t, c] = x[t, :] . a[layer, s, c, :],
// s = slots[t]. a [L, S, C*R, K] and b [L, S, R, N] are whole stacks read in place (float32 or
// bfloat16, widened exactly), x float32, sums float32; slot 0 is "no adapter": its rows are zero and
// cost nothing. Tokens are grouped by slot and cut into tiles of up to kTile tokens; a tile reads its
// slot's A (dot products along K, which is contiguous) and then B (rows of N, contiguous), so a
// slot's weights stream once per tile. Work items are (tile, column chunk): when there are fewer
// tiles than threads, a tile's columns are split and each chunk recomputes the tile's small u.
//
// Every output element is summed in the same order whatever the batch holds (k ascending in
// sixteens, then j ascending), so a row's delta does not depend on the other rows of the step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "row_tiles.h"
#include "thread_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using infire::row_tiles;
using infire::run_chunks;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline v16 load16(const uint16_t* p) {  // bfloat16 is the top half of a float32
  h16 h; std::memcpy(&h, p, sizeof(h));
  const u16x bits = __builtin_convertvector(h, u16x) << 16;
  v16 v; std::memcpy(&v, &bits, sizeof(v)); return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

constexpr int kTile = 8;         // tokens of one slot per work item
constexpr int64_t kStrip = 512;  // output columns summed in registers / L1 at once

// u[m, c .. c + MR) for MT tokens: dot products of x rows with rows c.. of a, along K.
template <int MT, int MR, typename W>
inline void shrink_tile(const float* const* xs, int64_t K, const W* a, int64_t c, float* u, int64_t CR) {
  v16 acc[MR][MT];
  for (int r = 0; r < MR; ++r) for (int m = 0; m < MT; ++m) acc[r][m] = v16{};
  for (int64_t k = 0; k < K; k += 16) {
    v16 av[MR];
    for (int r = 0; r < MR; ++r) av[r] = load16(a + (c + r) * K + k);
    for (int m = 0; m < MT; ++m) {
      const v16 xv = load16(xs[m] + k);
      for (int r = 0; r < MR; ++r) acc[r][m] += av[r] * xv;
    }
  }
  for (int m = 0; m < MT; ++m) for (int r = 0; r < MR; ++r) u[m * CR + c + r] = hsum(acc[r][m]);
}

template <int MT, typename W>
inline void shrink(const float* const* xs, int64_t K, const W* a, int64_t CR, float* u) {
  int64_t c = 0;
  for (; c + 4 <= CR; c += 4) shrink_tile<MT, 4>(xs, K, a, c, u, CR);
  for (; c < CR; ++c) shrink_tile<MT, 1>(xs, K, a, c, u, CR);
}

struct Item {
  int32_t slot;
  int64_t first, count;  // tokens order[first .. first + count)
  int64_t c0, c1;        // output columns
};

template <typename W>
void run(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const W* a, int64_t S, int64_t CR,
         const W* b, int64_t R, int64_t N, const int32_t* slots, const int32_t* members, float* y) {
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) start[slots[t] + 1]++;
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  std::vector<int64_t> order(T), fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) order[fill[slots[t]]++] = t;
  for (int64_t i = start[0]; i < start[1]; ++i) std::memset(y + order[i] * N, 0, N * sizeof(float));

  int64_t tiles = 0;
  for (int64_t s = 1; s < S; ++s) tiles += (start[s + 1] - start[s] + kTile - 1) / kTile;
  if (tiles == 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t split = tiles >= threads ? 1 : (threads + tiles - 1) / tiles;
  const int64_t chunk = std::max<int64_t>(64, ((N + split - 1) / split + 15) / 16 * 16);
  std::vector<Item> items;
  for (int64_t s = 1; s < S; ++s)
    for (int64_t i = start[s]; i < start[s + 1]; i += kTile)
      for (int64_t c0 = 0; c0 < N; c0 += chunk)
        items.push_back({int32_t(s), i, std::min<int64_t>(kTile, start[s + 1] - i), c0, std::min(N, c0 + chunk)});

  run_chunks(pool, int64_t(items.size()), [&](int64_t w) {
    const Item& it = items[w];
    const W* as = a + it.slot * CR * K;
    const W* bs = b + it.slot * R * N;
    const float* xs[kTile];
    for (int64_t m = 0; m < it.count; ++m) xs[m] = x + order[it.first + m] * K;
    std::vector<float> uv(it.count * CR);
    row_tiles<4>(it.count, [&](auto rows, int64_t m) { shrink<rows.value>(xs + m, K, as, CR, uv.data() + m * CR); });
    for (int64_t col0 = it.c0; col0 < it.c1; col0 += kStrip) {
      const int64_t nv = (std::min(it.c1, col0 + kStrip) - col0) / 16;
      v16 acc[kTile][kStrip / 16];
      for (int64_t m = 0; m < it.count; ++m) for (int64_t j = 0; j < nv; ++j) acc[m][j] = v16{};
      for (int64_t r = 0; r < R; ++r) {
        const W* br = bs + r * N + col0;
        for (int64_t j = 0; j < nv; ++j) {
          const v16 bv = load16(br + 16 * j);
          const int64_t col = members[col0 / 16 + j] * R + r;
          for (int64_t m = 0; m < it.count; ++m) acc[m][j] += uv[m * CR + col] * bv;
        }
      }
      for (int64_t m = 0; m < it.count; ++m)
        for (int64_t j = 0; j < nv; ++j) store16(y + order[it.first + m] * N + col0 + 16 * j, acc[m][j]);
    }
  });
}

}  // namespace

static ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer b,
                       ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> members, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || ad[0] != bd[0] || ad[1] != bd[1] || ad[3] != xd[1] ||
      ad[2] % bd[2] != 0 || xd[1] % 16 != 0 || bd[3] % 16 != 0)
    return ffi::Error::InvalidArgument("lora_sgmv: x [T, K], a [L, S, C*R, K], b [L, S, R, N], K and N multiples of 16");
  if (x.element_type() != ffi::DataType::F32 || a.element_type() != b.element_type())
    return ffi::Error::InvalidArgument("lora_sgmv: float32 x, and a and b of one dtype");
  const int64_t T = xd[0], K = xd[1], L = ad[0], S = ad[1], CR = ad[2], R = bd[2], N = bd[3];
  if (slots.element_count() != T || members.element_count() != N / 16)
    return ffi::Error::InvalidArgument("lora_sgmv: slots [T] and members [N / 16]");
  const int32_t l = *layer.typed_data();
  const int32_t* sp = slots.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] < 0 || sp[t] >= S) return ffi::Error::InvalidArgument("lora_sgmv: a slot is out of range");
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("lora_sgmv: layer out of range");
  const float* xp = static_cast<const float*>(x.untyped_data());
  if (a.element_type() == ffi::DataType::F32) {
    run(pool, xp, T, K, static_cast<const float*>(a.untyped_data()) + l * S * CR * K, S, CR,
        static_cast<const float*>(b.untyped_data()) + l * S * R * N, R, N, sp, members.typed_data(), y->typed_data());
  } else if (a.element_type() == ffi::DataType::BF16) {
    run(pool, xp, T, K, static_cast<const uint16_t*>(a.untyped_data()) + l * S * CR * K, S, CR,
        static_cast<const uint16_t*>(b.untyped_data()) + l * S * R * N, R, N, sp, members.typed_data(),
        y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("lora_sgmv: the stacks must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireLoraSgmv, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
