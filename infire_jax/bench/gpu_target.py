"""The engine's GPU programs, compiled on a machine without a GPU (../shared/design/DEVICELESS.md).

With the CUDA plugin installed (`jax-cuda12-plugin`, `jax-cuda12-pjrt` and ptxas from
`nvidia-cuda-nvcc-cu12`: the `dev` extra) and `JAX_PLATFORMS=cpu`, the plugin's compiler still
serves a topology of GPUs described by a target config, and `jit(...).lower(...).compile()` on
arguments placed on its devices gives real sm_90a machine code, its memory analysis and (with
`xla_dump_to`) XLA's launch list. The engine builds for the target as it would on one
(`placement.compiling_for("gpu")`: the GPU's kernels and defaults), from the weights' and the pool's
shapes alone (`DeviceMemory(allocate=False)`), so nothing is allocated or read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from infire_jax.errors import ConfigError

# A target's `stream_executor::GpuTargetConfigProto` fields (the vendors' figures; the compiler reads
# the compute capability, SM count and shared memory limits).
_TARGET_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: {l2} clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    device_kind: str
    memory_bytes: int  # what the card reports as its total
    bandwidth: float  # HBM bytes/s (vendor)

    def config_text(self) -> str:
        return _TARGET_CONFIG.format(bandwidth=int(self.bandwidth), l2=52428800, memory=self.memory_bytes,
                                     name=self.device_kind)


TARGETS = {
    "h100": Target("h100", "NVIDIA H100 80GB HBM3", 84_929_347_584, 3.35e12),
    "h200": Target("h200", "NVIDIA H200", 143_771 * (1 << 20), 4.8e12),  # nvidia-smi's 143,771 MiB
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ConfigError(f"unknown GPU target {name!r}; choose one of {sorted(TARGETS)}")
    return TARGETS[name]


def here() -> Target:
    """This machine's GPU as a target (its own devices: `devices(..., here=True)`)."""
    kind = jax.devices()[0].device_kind
    return TARGETS["h200" if "H200" in kind else "h100"]


def device_count(requested: int | None, mesh) -> int:
    """The GPUs to compile for: as requested, else the mesh's (a file's or -tp/-pp's) devices, else one."""
    if requested is not None:
        return requested
    if mesh is None:
        return 1
    from sharding.mesh import MeshConfig

    return (mesh if isinstance(mesh, MeshConfig) else MeshConfig.from_yaml(mesh)).num_devices


def devices(t: Target, count: int = 1, here: bool = False) -> list:
    """`count` GPUs of one host of target `t`, as devices to compile for (not to run on); with `here`,
    this machine's own GPUs, for comparing what it compiles with the prediction."""
    from jax.experimental import topologies

    if here:
        if jax.default_backend() != "gpu" or jax.device_count() < count:
            raise ConfigError(f"--here compiles for this machine's GPUs: it has {jax.device_count()} "
                              f"{jax.default_backend()} devices")
        return jax.devices()[:count]
    if jax.default_backend() != "cpu":
        raise ConfigError("compiling for a GPU target runs on a CPU machine: set JAX_PLATFORMS=cpu")
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                            target_config=t.config_text())
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise ConfigError(f"no CUDA compiler here ({type(e).__name__}: {e}); install the dev extra (jax-cuda12-"
                          "plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12) and set JAX_PLATFORMS=cpu") from e
    return list(topo.devices)


def on_device(tree, device):
    """Every array or shape of `tree` as a shape on `device` (a target device: nothing is allocated)."""
    return _placed(tree, jax.sharding.SingleDeviceSharding(device), keep=False)


def _placed(tree, default, keep: bool = True):
    """Every array or shape of `tree` as a shape on `default` (one device's sharding, or a mesh's
    replicated one); with `keep`, a shape that has a sharding of its own keeps it (a plan's weights
    and pool, laid out on the target's mesh). Arrays live on this machine: only their shapes count."""
    def one(a):
        if isinstance(a, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            own = a.sharding if keep and isinstance(a, jax.ShapeDtypeStruct) else None
            return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=own or default,
                                        weak_type=bool(getattr(a, "weak_type", False)))
        return a

    return jax.tree.map(one, tree)


def peak_bytes(compiled: jax.stages.Compiled) -> int:
    """A compiled program's peak on one device, from XLA's memory analysis: arguments and outputs
    (donated ones once) and temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


@dataclasses.dataclass
class CompiledProgram:
    name: str  # e.g. "burst-greedy 64 tokens"
    compiled: jax.stages.Compiled
    dump_dir: str | None
    seconds: float
    steps: int  # engine steps a run of it takes (a decode burst's steps; else 1)
    cache_name: str = ""  # its name in the executable cache (e.g. "burst-greedy")
    args: tuple = ()  # the arguments it was compiled for, as shapes on the target's devices


def _quantized(ec, cfg) -> dict | None:
    """The quantized weights' layouts of `ec`'s model as the engine would place them, from shapes
    alone: a `dummy:` model's drawn int4 / int8 / fp8 parts (a checkpoint's own come from its files)."""
    if not ec.weights_quantization:
        return None
    from infire_jax.loaders import gpt_oss_quant, kept_8bit

    dummy = (ec.model or "").startswith("dummy:")
    if ec.weights_quantization == "checkpoint" and dummy and gpt_oss_quant.is_gpt_oss(ec.model):
        return gpt_oss_quant.kept_layouts()  # its MXFP4 experts, as a dummy draws them
    if ec.weights_quantization == "checkpoint" and dummy and kept_8bit.keeps(ec.model):
        return kept_8bit.dummy_layouts(ec.model)  # its published 8-bit form (MiniMax-M2's fp8 blocks)
    if not dummy or ec.weights_quantization not in ("int4", "int8", "fp8"):
        raise ConfigError(f"a GPU target builds the quantized weights of a dummy: model (--weights-quantization "
                          f"int4, int8 or fp8, or checkpoint for gpt-oss and MiniMax-M2) from their shapes; got "
                          f"{ec.model!r} with {ec.weights_quantization!r}")
    from infire_jax.loaders.gguf_quant import DEFAULT_INT4_GROUP, dummy_layouts

    return dummy_layouts(cfg, ec.weights_quantization, ec.int4_group_size or DEFAULT_INT4_GROUP)


class TargetEngine:
    """The engine of `ec` built for `count` GPUs of target `t` (a mesh from `ec.mesh` or the shipped
    file for the count, as on the GPUs themselves) from its weights' and pool's shapes alone (a
    dummy's quantized ones included: `_quantized`). With `t` None, for this machine's own devices
    as they are (its CPU: `infire-jax precompile` without a target)."""

    def __init__(self, ec, t: Target | None, count: int = 1, here: bool = False):
        from infire_jax.engine.setup import resolve_settings
        from infire_jax.models.registry import abstract_state
        from infire_jax.runner import executable_cache
        from infire_jax.runner.compiled_steps import CompiledSteps
        from infire_jax.runner.device_memory import DeviceMemory

        self.target = t
        self.devices = jax.devices() if t is None else devices(t, count, here)
        # Executables are keyed for the machine that will run them: a topology's are a GPU's.
        platform = None if t is None or here else executable_cache.gpu_platform(t.device_kind)
        with self.building():
            self.settings = s = resolve_settings(ec, None)
            graphdef, state = abstract_state(s.model_config, s.dtype, s.plan, _quantized(ec, s.model_config))
            self.memory = DeviceMemory(s.placed_config, graphdef, state, s.runner_config, dtype=s.dtype,
                                       plan=s.plan, allocate=False)
            self.steps = CompiledSteps(self.memory, platform)

    def building(self):
        """The context the engine's programs are traced in: the target's kernels and devices (process-
        wide: enter it once around compiles that run on several threads)."""
        from pallas_kernels import placement

        return contextlib.nullcontext() if self.target is None else placement.compiling_for("gpu", self.devices)

    def weights_per_device(self) -> tuple[list[tuple[int, ...]], int, int]:
        """One device's shards of the weights: each layer weight's shape (the unstacked weights whole),
        the layers its stacks hold, and its bytes."""
        leaves = jax.tree.leaves(self.memory.state)
        local = [tuple(a.sharding.shard_shape(a.shape)) if getattr(a, "sharding", None) is not None
                 else tuple(a.shape) for a in leaves]
        leading = [shape[0] for shape in local if len(shape) >= 3]
        layers = max(set(leading), key=leading.count) if leading else 0
        shapes = [shape[1:] if len(shape) >= 2 and shape[0] == layers else shape for shape in local]
        nbytes = sum(math.prod(shape) * jnp.dtype(a.dtype).itemsize for shape, a in zip(local, leaves))
        return shapes, layers, nbytes

    def kv_pool_bytes_per_device(self) -> int:
        pages = (self.memory.cache.k_pages, self.memory.cache.v_pages)
        return sum(math.prod(p.sharding.shard_shape(p.shape) if p.sharding is not None else p.shape)
                   * jnp.dtype(p.dtype).itemsize for p in pages)

    def specs(self, only: tuple[str, ...] = ()) -> dict[str, tuple[str, object, tuple]]:
        """The programs the engine serves with, as its warmup compiles them (every bucket's forward,
        samplers and decode bursts, the verifying programs with speculation, the small ones, a
        prompt-logprob gather per bucket), by name: (their executable-cache name, the jitted function,
        the arguments as shapes on the target's devices); `only` keeps names starting so."""
        steps, rc, plan = self.steps, self.settings.runner_config, self.settings.plan
        default = plan.replicated if plan else jax.sharding.SingleDeviceSharding(self.devices[0])
        with self.building():
            specs = {}
            for key, spec in steps.small_specs().items():
                specs[spec[0] if key[0] == "small" else f"{spec[0]} {key[1].num_tokens} tokens"] = spec
            for shape in rc.buckets.shapes:
                for key, spec in steps.bucket_specs(shape, rc.empty_batch(shape)).items():
                    specs.setdefault(f"{spec[0]} {shape.num_tokens} tokens"
                                     if key[0] in ("forward", "verify_forward", "burst")
                                     else f"{spec[0]} {shape.num_rows} rows", spec)  # a sampler serves a row count
        return {name: (kind, jitted, _placed(args, default)) for name, (kind, jitted, args) in specs.items()
                if not only or name.startswith(only)}

    def compile(self, name: str, spec: tuple[str, object, tuple], dump_root: str | None = None) -> CompiledProgram:
        """One of `specs()` compiled (inside `building()`), dumped into a directory of its own under
        `dump_root` (None: not dumped)."""
        kind, jitted, args = spec
        dump = None if dump_root is None else tempfile.mkdtemp(prefix=name.replace(" ", "_") + ".", dir=dump_root)
        options = None if dump is None else {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        start = time.perf_counter()
        compiled = jitted.lower(*args).compile(compiler_options=options)
        return CompiledProgram(name, compiled, dump, time.perf_counter() - start,
                               self.settings.runner_config.decode_steps if kind.startswith("burst") else 1, kind, args)

    def programs(self, dump_root: str | None, only: tuple[str, ...] = ()) -> Iterator[CompiledProgram]:
        """`specs()` compiled one after another (each compile timed alone)."""
        with self.building():
            for name, spec in self.specs(only).items():
                yield self.compile(name, spec, dump_root)


def use_cpu_backend() -> None:
    """Has jax start the CPU backend alone (`jax_platforms="cpu"`), before it starts any: with the
    CUDA plugin installed and no GPU, starting its backend fails (cuInit) and unregisters the plugin,
    whose compiler the target devices need."""
    from infire_jax.runner.xla_flags import backend_started

    if not backend_started():
        jax.config.update("jax_platforms", "cpu")
