"""Places small models on 8 virtual CPU devices and prints, per (model, mesh), the weight bytes each
device holds by parameter name (a kept weight's parts as "wqkv.q4") and the KV pool bytes per token
per device (for test_memplan.py).

Usage: python memplan_worker.py JOB.json   (JOB: {"runs": [{"config": HF dict, "mesh": path}, ...]}; a run
with "checkpoint": a GPTQ / AWQ directory places it as `weights_quantization="checkpoint"` does; with
"checkpoint" and "at_load": [MODE, GROUP], a float directory as `weights_quantization=MODE` does)
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from infire_jax.loaders.load import load_quantized_placed
    from infire_jax.loaders.hf import read_hf_config
    from infire_jax.models.hf_config import config_from_hf
    from infire_jax.models.registry import abstract_placement, build_state
    from sharding.mesh import MeshConfig
    from sharding.plan import KV_POOL_AXES, ShardPlan

    with open(sys.argv[1]) as f:
        job = json.load(f)
    pages, page_size = 8, 4
    for run in job["runs"]:
        mc = MeshConfig.from_yaml(run["mesh"])
        cfg = read_hf_config(run["checkpoint"]) if "checkpoint" in run else config_from_hf(run["config"])
        plan = ShardPlan.create(cfg, mc)
        if "at_load" in run:  # a float checkpoint quantized at load (int4: in groups of the run's GROUP)
            state = load_quantized_placed(run["checkpoint"], jnp.float32, plan, *run["at_load"]).state
        elif "checkpoint" in run:
            state = load_quantized_placed(run["checkpoint"], jnp.float32, plan, "checkpoint").state
        else:  # zeros through the checkpoint path (prepared for the plan, then put on its devices), as a
            # loaded model's weights are placed: a `dummy:` draw compiles a program a weight (~1.5 s each)
            _, flat, _ = abstract_placement(cfg, jnp.float32, None)
            zeros = {".".join(map(str, p)): np.zeros(var.shape, var.dtype) for p, var in flat}
            _, state = build_state(cfg, zeros, jnp.float32, plan=plan)
        per_name: dict[str, list[int]] = {}
        for path, var in nnx.to_flat_state(state):
            arr = var.get_value()
            by_device = {d: 0 for d in plan.mesh.devices.flat}
            for shard in arr.addressable_shards:
                by_device[shard.device] += shard.data.nbytes
            per_name[".".join(map(str, path)).removeprefix("layers.")] = [by_device[d] for d in plan.mesh.devices.flat]
        placed = plan.effective_config(cfg)
        shape = (placed.num_layers, pages, page_size, placed.num_kv_heads, placed.head_dim)
        pool = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=plan.sharding(KV_POOL_AXES))()
        kv = max(s.data.nbytes for s in pool.addressable_shards) * 2 / (pages * page_size)  # k and v pools
        print(json.dumps({"mesh": run["mesh"], "name": run["name"], "bytes": per_name, "kv_per_token": kv}),
              flush=True)


if __name__ == "__main__":
    main()
