// The skinny matmul of CPU decode steps, as an XLA FFI custom call (pallas_kernels/cpu_matmul.py).
//
// y[M, N] = x[M, K] . w[layer, K, N] for M <= 16 (the tokens of a decode step): layer `layer` of a
// stacked row-major weight, float32 or bfloat16 (widened exactly in registers), read in place (no
// copy of the slice). Every row of w is streamed once per call on XLA's own intra-op thread pool,
// each thread over its own column chunks, with the chunk's partial sums in L1. Float32 sums.
//
// Every output element is summed in the same order whatever M is (four rows of w per step, k
// ascending), so a row's result does not depend on the other rows of the batch.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
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

// Columns [c0, c1) of y (a multiple of 16 wide) for MB rows of x, four rows of w per step.
template <int MB, typename W>
static void strip(const float* x, int64_t K, const W* w, int64_t N, int64_t c0, int64_t c1, float* y) {
  const int64_t nv = (c1 - c0) / 16;
  v16 acc[MB][32];  // up to 512 columns per call
  for (int m = 0; m < MB; ++m) for (int64_t j = 0; j < nv; ++j) acc[m][j] = v16{};
  for (int64_t k = 0; k < K; k += 4) {
    const W* w0 = w + k * N + c0;
    float xs[MB][4];
    for (int m = 0; m < MB; ++m) for (int i = 0; i < 4; ++i) xs[m][i] = x[m * K + k + i];
    for (int64_t j = 0; j < nv; ++j) {
      const v16 a = load16(w0 + 16 * j), b = load16(w0 + N + 16 * j), c = load16(w0 + 2 * N + 16 * j),
                d = load16(w0 + 3 * N + 16 * j);
      for (int m = 0; m < MB; ++m) acc[m][j] += xs[m][0] * a + xs[m][1] * b + xs[m][2] * c + xs[m][3] * d;
    }
  }
  for (int m = 0; m < MB; ++m) for (int64_t j = 0; j < nv; ++j) store16(y + m * N + c0 + 16 * j, acc[m][j]);
}

template <typename W>
static void run_strip(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t c0, int64_t c1, float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * K; float* ym = y + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: strip<1>(xm, K, w, N, c0, c1, ym); break;
      case 2: strip<2>(xm, K, w, N, c0, c1, ym); break;
      case 3: strip<3>(xm, K, w, N, c0, c1, ym); break;
      case 4: strip<4>(xm, K, w, N, c0, c1, ym); break;
      case 5: strip<5>(xm, K, w, N, c0, c1, ym); break;
      case 6: strip<6>(xm, K, w, N, c0, c1, ym); break;
      case 7: strip<7>(xm, K, w, N, c0, c1, ym); break;
      default: strip<8>(xm, K, w, N, c0, c1, ym); break;
    }
  }
}

struct Shared {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// Runs fn(0), ..., fn(chunks - 1) on the calling thread and XLA's pool; returns when all are done.
template <typename F>
static void run_chunks(ffi::ThreadPool& pool, int64_t chunks, F fn) {
  auto sh = std::make_shared<Shared>();
  sh->chunks = chunks;
  auto work = [sh, fn]() {
    int64_t c;
    while ((c = sh->next.fetch_add(1)) < sh->chunks) {
      fn(c);
      if (sh->done.fetch_add(1) + 1 == sh->chunks) { std::lock_guard<std::mutex> g(sh->mu); sh->cv.notify_all(); }
    }
  };
  // A helper that starts after the chunks are gone finds none and returns; the state is shared.
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(std::function<void()>(work));
  work();
  std::unique_lock<std::mutex> g(sh->mu);
  sh->cv.wait(g, [&] { return sh->done.load() == sh->chunks; });
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

static ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] % 16 != 0 || wd[1] % 4 != 0)
    return ffi::Error::InvalidArgument("skinny_matmul: x [M, K], w [L, K, N] with K % 4 == 0 and N % 16 == 0");
  const int64_t M = xd[0], K = xd[1], N = wd[2], l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("skinny_matmul: layer index out of range");
  if (w.element_type() == ffi::DataType::F32) {
    run(pool, x.typed_data(), M, K, static_cast<const float*>(w.untyped_data()) + l * K * N, N, y->typed_data());
  } else if (w.element_type() == ffi::DataType::BF16) {
    run(pool, x.typed_data(), M, K, static_cast<const uint16_t*>(w.untyped_data()) + l * K * N, N, y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("skinny_matmul: weights must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireSkinnyMatmul, Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
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

template <int MB, typename W>
static void rows_nt(const float* x, int64_t K, const W* w, int64_t V, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) row_tile<MB, 4>(x, K, w, V, n, y);
  for (; n < n1; ++n) row_tile<MB, 1>(x, K, w, V, n, y);
}

template <typename W>
static void run_nt(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const W* w, int64_t V, float* y) {
  const int64_t chunk = 256;  // rows of w per chunk
  run_chunks(pool, (V + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(V, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* xm = x + m0 * K; float* ym = y + m0 * V;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: rows_nt<1>(xm, K, w, V, n0, n1, ym); break;
        case 2: rows_nt<2>(xm, K, w, V, n0, n1, ym); break;
        case 3: rows_nt<3>(xm, K, w, V, n0, n1, ym); break;
        default: rows_nt<4>(xm, K, w, V, n0, n1, ym); break;
      }
    }
  });
}

static ffi::Error ImplNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % 16 != 0)
    return ffi::Error::InvalidArgument("skinny_matmul_nt: x [M, K], w [N, K] with K % 16 == 0");
  if (w.element_type() == ffi::DataType::F32) {
    run_nt(pool, x.typed_data(), xd[0], xd[1], static_cast<const float*>(w.untyped_data()), wd[0], y->typed_data());
  } else if (w.element_type() == ffi::DataType::BF16) {
    run_nt(pool, x.typed_data(), xd[0], xd[1], static_cast<const uint16_t*>(w.untyped_data()), wd[0], y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("skinny_matmul_nt: weights must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireSkinnyMatmulNT, ImplNT,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());
