// Work split over XLA's own intra-op thread pool, shared by the CPU kernels (csrc/*.cc).
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include "xla/ffi/api/ffi.h"

namespace infire {

struct ChunkState {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// Runs fn(0), ..., fn(chunks - 1) on the calling thread and XLA's pool; returns when all are done.
template <typename F>
static void run_chunks(xla::ffi::ThreadPool& pool, int64_t chunks, F fn) {
  auto sh = std::make_shared<ChunkState>();
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

}  // namespace infire
