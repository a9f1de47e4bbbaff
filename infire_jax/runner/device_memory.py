"""What a model keeps on the device, the base of the runner (runner.py): the placed weights, the KV
pool with the per-slot sampling state, and the all-allowed grammar masks. Allocating the pool,
sizing it again before warmup, an fp8 pool's scales, and hot standby's round trip (residency.py):
everything freed to host memory and placed back on the same shardings, so nothing recompiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.runner import multihost
from infire_jax.lora.layout import stack_layout
from infire_jax.models.config import ModelConfig
from infire_jax.models.gated_delta import LINEAR_STATE_AXES, LinearState, linear_state_shapes
from infire_jax.models.kv_entry import kv_entry
from infire_jax.models.panels import kernel_layout
from infire_jax.runner.config import RunnerConfig
from infire_jax.runner.step_programs import DeviceCache
from pallas_kernels.kv_quant import is_fp8
from pallas_kernels.reference import pool_storage_dtype
from sharding.plan import ShardPlan


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype, layers: int | None = None) -> int:
    """One page of the pool over `layers` layers (default: the model's with KV; a hybrid cache's page holds fewer)."""
    return kv_entry(cfg).bytes_per_page(cfg.num_kv_layers if layers is None else layers, page_size, jnp.dtype(dtype))



def _host_copy(a: np.ndarray) -> np.ndarray:
    """An array that owns its memory: on CPU, device_get may alias the device buffer about to be freed."""
    return a if a.base is None and a.flags.owndata else np.array(a, copy=True)


class DeviceMemory:
    """The arrays a runner holds on the device, and their life. `cache` is replaced by every step
    (its buffers are donated); `state` and `cache` are None while the model is off the device."""

    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, rc: RunnerConfig,
                 *, dtype, plan: ShardPlan | None = None, allocate: bool = True):
        """`cfg` is the placed model's config (a plan's effective config on a mesh); `state` may be
        the weights' shapes alone (attach_weights gives the weights). The runner owns the weights
        it is given: on CPU it may repack some for its matmul kernel (models/panels.py). With
        `allocate=False` the cache stays shapes too (`allocate_pool` allocates it): enough to compile
        the steps, for another machine's devices as well (bench/gpu_compile.py)."""
        self.cfg = cfg
        self.rc = rc
        self.plain_graphdef = graphdef  # the layout `attach_weights` receives
        self.graphdef, self.state = kernel_layout(graphdef, state, plan=plan)
        self.dtype = dtype
        self.plan = plan
        self._host_weights: tuple[nnx.State, nnx.State] | None = None  # a host copy and the shardings, once offloaded
        self.resident = True
        self.kv_dtype = jnp.dtype(rc.kv_cache_dtype or dtype)
        # An fp8 pool's [k_scale, v_scale] per (layer, kv head) (pallas_kernels/kv_quant.py): kept on the
        # host too, so a pool allocated again (restore, resize_pool) gets them back.
        self.kv_scales = (np.ones((cfg.num_kv_layers, 2, kv_entry(cfg).heads), np.float32)
                          if is_fp8(self.kv_dtype) else None)
        if allocate:
            self.cache = self._allocate_cache()
        else:
            self._cache_program()
            self.cache = self._cache_shapes
        # Structured outputs: a step with no constrained row passes its row bucket's all-allowed
        # grammar mask, kept on the device, instead of copying one (structured/, sample/sampler.py).
        self.mask_words = -(-cfg.vocab_size // 32)
        self._all_allowed: dict[int, jax.Array | None] = {}  # None while offloaded

    def _allocate_cache(self) -> DeviceCache:
        """The pool is split like the kv heads and layers; the per-slot history is replicated."""
        self._cache_program()
        return self._new_cache(self.kv_scales)

    def _cache_program(self) -> None:
        """The program that allocates an empty cache of the current sizes (kept, so a model coming back
        to the device allocates its pool without compiling), and the cache as shapes."""
        c, rc, plan = self.cfg, self.rc, self.plan
        entry = kv_entry(c)
        pool = plan.sharding(entry.pool_axes) if plan else None
        replicated = plan.replicated if plan else None

        stored = pool_storage_dtype(self.kv_dtype, rc.attn_impl)
        layers = rc.pool_layers(c.num_kv_layers)  # a hybrid cache's page holds one group's layers
        shapes = DeviceCache(
            k_pages=((layers, rc.num_pages, rc.page_size, entry.heads, entry.k_dim), stored),
            v_pages=((layers, rc.num_pages, rc.page_size, entry.heads, entry.v_dim), stored),
            counts=((rc.num_slots, c.vocab_size), jnp.int32), prompt_mask=((rc.num_slots, c.vocab_size), jnp.bool_),
            last_tokens=((rc.num_slots,), jnp.int32))
        # LoRA adapters' device slots (lora/layout.py): empty until an adapter is paged in.
        lora = None if rc.lora is None else stack_layout(c, rc.lora)
        linear = linear_state_shapes(c, rc.num_slots, self.dtype)
        snapshots = linear_state_shapes(c, rc.linear_snapshots, self.dtype) if rc.linear_snapshots else None
        linear_shardings = None if linear is None else LinearState(*(
            plan.sharding(axes) if plan else None for axes in LINEAR_STATE_AXES))
        shardings = DeviceCache(pool, pool, replicated, replicated, replicated,
                                None if self.kv_scales is None else replicated,
                                None if lora is None else {k: plan.sharding(axes) if plan else None
                                                           for k, (_, axes) in lora.items()},
                                None if rc.image_pool is None else replicated,
                                linear_shardings, None if snapshots is None else linear_shardings)
        dtype = self.dtype

        def new_cache(scales):
            stacks = None if lora is None else {k: jnp.zeros(shape, dtype) for k, (shape, _) in lora.items()}
            images = None if rc.image_pool is None else jnp.zeros(rc.image_pool, dtype)
            return DeviceCache(*(jnp.zeros(shape, dt) for shape, dt in shapes[:5]), kv_scales=scales, lora=stacks,
                               images=images, linear=None if linear is None else LinearState(
                                   *(jnp.zeros(shape, dt) for shape, dt in linear)),
                               linear_snapshots=None if snapshots is None else LinearState(
                                   *(jnp.zeros(shape, dt) for shape, dt in snapshots)))

        # Kept, so a model coming back to the device (restore) allocates its pool without compiling;
        # an fp8 pool's scales come from their host copy (set_kv_scales).
        self._new_cache = jax.jit(new_cache, out_shardings=shardings if plan else None)
        # Without a plan the allocated arrays are uncommitted: shapes without a sharding lower alike.
        scales = None if self.kv_scales is None else jax.ShapeDtypeStruct(self.kv_scales.shape, jnp.float32,
                                                                          sharding=replicated)
        self._cache_shapes = DeviceCache(
            *(jax.ShapeDtypeStruct(shape, dt, sharding=s) for (shape, dt), s in zip(shapes[:5], shardings[:5])),
            kv_scales=scales, lora=None if lora is None else {
                k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings.lora[k]) for k, (shape, _) in lora.items()},
            images=None if rc.image_pool is None else jax.ShapeDtypeStruct(rc.image_pool, dtype,
                                                                          sharding=shardings.images),
            linear=None if linear is None else LinearState(*(jax.ShapeDtypeStruct(shape, dt, sharding=s)
                                                             for (shape, dt), s in zip(linear, shardings.linear))),
            linear_snapshots=None if snapshots is None else LinearState(*(
                jax.ShapeDtypeStruct(shape, dt, sharding=s) for (shape, dt), s in zip(snapshots, shardings.linear))))

    def set_kv_scales(self, scales: np.ndarray) -> None:
        """An fp8 pool's scales, [layers, 2, kv heads] float32 (k, v); only before any page is written."""
        if self.kv_scales is None or scales.shape != self.kv_scales.shape:
            raise ValueError(f"kv scales of shape {scales.shape} for a {self.kv_dtype} pool "
                             f"(expected {None if self.kv_scales is None else self.kv_scales.shape})")
        self.kv_scales = np.asarray(scales, np.float32)
        self.cache = self.cache._replace(kv_scales=jax.device_put(self.kv_scales,
                                                                  self.plan.replicated if self.plan else None))

    def resize_pool(self, num_pages: int, allocate: bool = True) -> None:
        """Frees the KV pool and sizes it to `num_pages` (before warmup: the steps do not depend on it).

        With `allocate=False` the pool stays shapes alone until `allocate_pool`, so that the warmup
        compiles with the pool's memory still free: on a GPU, XLA's autotuning takes scratch memory
        (1.97 GiB at once for the 8B model), which a pool filling the allocator's share left no
        room for (kv_pool.py)."""
        self.rc = dataclasses.replace(self.rc, num_pages=num_pages)
        for a in jax.tree.leaves(self.cache):
            a.delete()
        if allocate:
            self.cache = self._allocate_cache()
        else:
            self._cache_program()
            self.cache = self._cache_shapes

    def allocate_pool(self) -> None:
        """Allocates the cache that `resize_pool(..., allocate=False)` left as shapes."""
        self.cache = jax.block_until_ready(self._new_cache(self.kv_scales))

    def attach_weights(self, state: nnx.State) -> None:
        """The weights, once read, for a runner built (and warmed up) on their shapes alone."""
        _, state = kernel_layout(self.plain_graphdef, state, plan=self.plan)
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self.state)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), state)
        if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
            raise RuntimeError("the loaded weights do not match the shapes the steps were compiled for")
        self.state = state

    def offload(self) -> int:
        """Frees the weights, the KV pool, the per-slot state and the all-allowed grammar masks on the
        device (hot standby: another model takes the device); returns the weight bytes. The weights
        never change, so the host copy made the first time serves every later offload: only that
        one copies device to host. Nothing of the model stays on the device: a buffer left behind
        the freed pool would split the free space that the next model's pool needs in one piece."""
        if multihost.is_multiprocess():
            raise RuntimeError("models cannot leave the device across several processes")
        if self._host_weights is None:
            # An uncommitted array (one device, no explicit placement) comes back uncommitted: the
            # compiled steps were specialized to that, and a committed one would make them recompile.
            shardings = jax.tree.map(lambda a: a.sharding if a.committed else None, self.state)
            self._host_weights = (jax.tree.map(_host_copy, jax.device_get(self.state)), shardings)
        for a in jax.tree.leaves(self.state) + jax.tree.leaves(self.cache) + list(self._all_allowed.values()):
            a.delete()
        self.state, self.cache, self.resident = None, None, False
        self._all_allowed = dict.fromkeys(self._all_allowed)
        return self.weight_bytes

    def restore(self) -> int:
        """Places the weights back on their shardings and allocates an empty pool: the compiled steps
        see the same shapes and shardings, so nothing recompiles. Returns the weight bytes placed.

        If the device runs out of memory meanwhile, what was placed is freed again and the error
        (jax's RESOURCE_EXHAUSTED) is raised: the model stays off the device."""
        host, shardings = self._host_weights
        placed: list[jax.Array] = []

        def put(x: np.ndarray, sharding) -> jax.Array:
            placed.append(jax.device_put(x, sharding))
            return placed[-1]

        try:
            state = jax.block_until_ready(jax.tree.map(put, host, shardings, is_leaf=lambda x: x is None))
            cache = jax.block_until_ready(self._new_cache(self.kv_scales))
            placed += jax.tree.leaves(cache)
            for rows in self._all_allowed:
                self._put_all_allowed(rows)
                placed.append(self._all_allowed[rows])
        except BaseException:
            for a in placed:
                a.delete()
            self._all_allowed = dict.fromkeys(self._all_allowed)
            raise
        self.state, self.cache, self.resident = state, cache, True
        return self.weight_bytes

    def _put_all_allowed(self, rows: int) -> None:
        self._all_allowed[rows] = jax.device_put(np.full((rows, self.mask_words), -1, np.int32),
                                                 self.plan.replicated if self.plan else None)

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self.state if self.resident else self._host_weights[0]))

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.k_pages.nbytes + self.cache.v_pages.nbytes

    def model(self) -> nnx.Module:
        """The model bound to the placed weights, for direct forwards outside the step (tests, tools)."""
        return nnx.merge(self.graphdef, self.state)
