"""Runs greedy generation for several (model, mesh) pairs in one process and prints JSON lines.

Used by test_sharding.py (and test_lora.py, test_llama4.py, test_vision_mesh.py) in subprocesses that have
8 virtual CPU devices (or several processes joined with jax.distributed). Usage: python sharded_worker.py JOB.json
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _prompt(p, tokenizer):
    """Ids of a text or id prompt, or a prompt dict with images ({"prompt": text, "images": [paths]})."""
    if isinstance(p, dict):
        from PIL import Image

        return {"prompt": p["prompt"], "multi_modal_data": {"image": [Image.open(path) for path in p["images"]]}}
    return p if isinstance(p, list) else tokenizer.encode(p)


def _record_drafts(engine) -> list:
    """Every proposal the engine's draft proposer hands out, as (the request's tokens then, the drafts)."""
    records, propose = [], engine.draft.propose

    def recording(reqs, ks):
        out = propose(reqs, ks)
        records.extend((list(r.all_token_ids), list(d)) for r, d in zip(reqs, out))
        return out

    engine.draft.propose = recording
    return records


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    dist = job.get("distributed")
    if dist:
        from sharding.distributed import initialize

        initialize(dist["address"], dist["num_processes"], dist["process_id"])
    import jax

    from infire_jax import LLM, SamplingParams
    from infire_jax.errors import ConfigError
    from infire_jax.lora import LoRARequest

    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True, logprobs=1,
                            prompt_logprobs=job.get("prompt_logprobs"))
    for run in job["runs"]:
        result = {"model": run["model"], "mesh": run["mesh"], "weights_compression": run.get("weights_compression"),
                  "tag": run.get("tag")}
        try:
            with environment(run.get("env", {})):  # read while the engine compiles its programs
                llm = LLM(model=run["model"], mesh=run["mesh"], dtype=run.get("dtype", "float32"),
                          weights_compression=run.get("weights_compression"),
                          weights_quantization=run.get("weights_quantization"),
                          int4_group_size=run.get("int4_group_size"),
                          speculative_config=run.get("speculative_config"),
                          **{**job["engine"], **run.get("engine", {})})  # a run's own engine settings win
                if run.get("env"):  # the Pallas kernels of the smallest bucket's forward, traced under it
                    from test_step_program import forward_jaxpr, kernel_names

                    tokens = llm.engine.runner.rc.buckets.shapes[0].num_tokens
                    result["kernels"] = kernel_names(forward_jaxpr(llm.engine.runner, tokens))
        except ConfigError as e:
            result.update(fits=False, error=str(e))
            print(json.dumps(result), flush=True)
            continue
        if jax.process_index() != 0:
            llm.engine.follow()
            del llm
            continue
        prompts = [_prompt(p, llm.tokenizer) for p in job["prompts"]]
        lora = job.get("lora")  # [name, id, path]: every prompt with that LoRA adapter
        drafts = _record_drafts(llm.engine) if llm.engine.draft is not None else None
        outs = llm.generate(prompts, params, lora_request=LoRARequest(*lora) if lora else None)
        if llm.engine.spec is not None:  # speculation: its counters, and a draft head's proposals in order
            stats = llm.engine.spec.stats
            result["spec"] = {"drafted": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
                              "proposals": drafts, "compiles": llm.engine.compiles_since_warmup}
            if hasattr(llm.engine.draft, "state"):  # a draft head's weights: each one's bytes, on each device
                from flax import nnx

                result["spec"]["params"] = {".".join(map(str, path)): [
                    int(v.get_value().nbytes), [int(s.data.nbytes) for s in v.get_value().addressable_shards]]
                    for path, v in nnx.to_flat_state(llm.engine.draft.state)}
                # its one-layer pool: bytes on each device, and the tokens it holds
                pool = llm.engine.draft.kv
                result["spec"]["pool"] = [sum(int(s.data.nbytes) for a in pool for s in a.addressable_shards
                                              if s.device == d)
                                          for d in sorted(pool[0].sharding.device_set, key=lambda d: d.id)]
                result["spec"]["pool_tokens"] = int(pool[0].shape[1] * pool[0].shape[2])
        kv, groups = llm.engine.kv, llm.engine.runner.rc.kv_groups
        linear = llm.engine.runner.cache.linear
        if linear is not None and llm.engine.plan is not None:  # a Qwen3.5's linear state on a mesh: each array's
            # split and its bytes on each device
            result["linear_state"] = {name: {"spec": [a for a in arr.sharding.spec], "global": int(arr.nbytes),
                                             "per_device": [int(s.data.nbytes) for s in arr.addressable_shards]}
                                      for name, arr in linear._asdict().items()}
        if llm.engine.images is not None:  # the vision tower's and the image pool's bytes on each device
            arrays = [*jax.tree.leaves(llm.engine.images.pool.weights), llm.engine.runner.cache.images]
            shards = [s for a in arrays for s in a.addressable_shards]
            result["vision_bytes"] = {str(d.id): sum(s.data.nbytes for s in shards if s.device == d)
                                      for d in sorted({s.device for s in shards}, key=lambda d: d.id)}
        result.update(pages_free=[kv.num_free_pages, kv.num_usable_pages],
                      kv_groups=None if groups is None else groups.describe())
        llm.engine.close()
        result.update(fits=True, tokens=[o.token_ids for o in outs],
                      logprobs=[[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])
        if params.prompt_logprobs is not None:  # each prompt token's (logprob, rank), and each position's top ids
            result["prompt_logprobs"] = [[(e[t].logprob, e[t].rank) for e, t in zip(o.prompt_logprobs[1:], p[1:])]
                                         for o, p in zip(outs, prompts)]
            result["prompt_top"] = [[sorted((lp.rank, i) for i, lp in e.items() if lp.rank <= params.prompt_logprobs)
                                     for e in o.prompt_logprobs[1:]] for o in outs]
        if llm.engine.runner.kv_scales is not None:  # an fp8 pool's calibrated scales, in the pool's layout
            result["kv_scales"] = llm.engine.runner.kv_scales.tolist()
        plan = llm.engine.plan
        if plan is not None:
            from flax import nnx

            result["params"] = {
                ".".join(map(str, path)): {
                    "global": int(v.get_value().nbytes),
                    "per_device": [int(s.data.nbytes) for s in v.get_value().addressable_shards],
                    "spec": [list(a) if isinstance(a, tuple) else a for a in v.get_value().sharding.spec],
                } for path, v in nnx.to_flat_state(llm.engine.runner.state)}
            result["mesh_sizes"] = plan.sizes
        print(json.dumps(result), flush=True)
        del llm, outs
        gc.collect()  # one engine's pool at a time: all 8 virtual devices share host memory


if __name__ == "__main__":
    main()
