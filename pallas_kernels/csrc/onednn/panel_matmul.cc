// The bfloat16 panel matmul through oneDNN (pallas_kernels/cpu_onednn.py): on a CPU with AMX its
// brgemm kernels multiply on the tile units (`tdpbf16ps`), which the hand-written `vdpbf16ps` kernel
// (csrc/skinny_matmul.cc) cannot reach.
//
// y[M, N] = x[M, K] . w[layer] in float32, w a stack of bfloat16 panels [L, N / 32, K / 2, 64]
// (cpu_matmul.pack_panels). For K a multiple of 32 a layer's panels are oneDNN's blocked weight
// format BA16a32b2a (blocks of 32 columns outer, 32 inputs inner, each block [16 pairs][32 columns][2]),
// so oneDNN reads the stack in place: no copy and no reorder. One primitive per (M, K, N), made on
// first use and kept; a scratchpad per calling thread (the primitive runs on oneDNN's OpenMP threads).
//
// The call runs with the default floating-point environment (no flush-to-zero, no denormals-are-zero),
// restoring XLA's afterwards: OpenMP's worker threads are made by the thread that first runs a
// parallel region and keep its MXCSR, and libgomp is one per process (torch's tests load the same), so
// workers made under XLA's flush-to-zero would flush every later OpenMP caller's denormals too. The
// tile and `vdpbf16ps` products ignore MXCSR; it decides only oneDNN's float32 sums across K blocks.
#include <xmmintrin.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using dims = dnnl::memory::dims;
using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::matmul::primitive_desc make_desc(int64_t m, int64_t k, int64_t n) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return dnnl::matmul::primitive_desc(cpu_engine(), dnnl::memory::desc({m, k}, dt::bf16, tag::ab),
                                      dnnl::memory::desc({k, n}, dt::bf16, tag::BA16a32b2a),
                                      dnnl::memory::desc({m, n}, dt::f32, tag::ab), attr);
}

// The primitive of one shape (made once: oneDNN generates its kernel then).
struct Matmul {
  dnnl::matmul::primitive_desc desc;
  dnnl::matmul prim;
};

const Matmul& matmul(int64_t m, int64_t k, int64_t n) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, Matmul> made;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(m, k, n);
  auto it = made.find(key);
  if (it == made.end()) {
    auto desc = make_desc(m, k, n);
    it = made.emplace(key, Matmul{desc, dnnl::matmul(desc)}).first;
  }
  return it->second;
}

}  // namespace

static ffi::Error Impl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(); auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != 64 || xd[1] != 2 * wd[2] || xd[1] % 32)
    return ffi::Error::InvalidArgument("onednn_panel_matmul: x [M, K] and panels [L, N / 32, K / 2, 64], "
                                       "K a multiple of 32");
  const int64_t M = xd[0], K = xd[1], N = 32 * wd[1], l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("onednn_panel_matmul: layer index out of range");
  if (M == 0) return ffi::Error::Success();
  const unsigned int xla_csr = _mm_getcsr();
  _mm_setcsr(xla_csr & ~(_MM_FLUSH_ZERO_ON | 0x0040u));  // 0x0040: denormals-are-zero
  struct Restore { unsigned int csr; ~Restore() { _mm_setcsr(csr); } } restore{xla_csr};
  try {
    const Matmul& mm = matmul(M, K, N);
    thread_local std::vector<uint8_t> scratch;
    const size_t need = mm.desc.scratchpad_desc().get_size();
    if (scratch.size() < need) scratch.resize(need);
    auto* panels = static_cast<uint16_t*>(w.untyped_data()) + l * K * N;
    dnnl::engine& engine = cpu_engine();
    dnnl::stream stream(engine);
    mm.prim.execute(stream, {{DNNL_ARG_SRC, dnnl::memory(mm.desc.src_desc(), engine, x.untyped_data())},
                             {DNNL_ARG_WEIGHTS, dnnl::memory(mm.desc.weights_desc(), engine, panels)},
                             {DNNL_ARG_DST, dnnl::memory(mm.desc.dst_desc(), engine, y->untyped_data())},
                             {DNNL_ARG_SCRATCHPAD, dnnl::memory(mm.desc.scratchpad_desc(), engine, scratch.data())}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("onednn_panel_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(InfireOnednnPanelMatmul, Impl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());

// Whether oneDNN multiplies on AMX tiles here (the CPU has them and the kernel granted their state).
extern "C" int InfireOnednnAmx() {
  const auto amx = static_cast<int>(dnnl::cpu_isa::avx512_core_amx);
  return (static_cast<int>(dnnl::get_effective_cpu_isa()) & amx) == amx;
}

// The instruction set oneDNN dispatches to, by name.
extern "C" const char* InfireOnednnIsaName() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    default: return "older than avx2";
  }
}
