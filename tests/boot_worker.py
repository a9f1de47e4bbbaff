"""One engine start in a fresh process (tests/test_executable_cache.py): a small engine on random
weights of SmolLM2's shape, greedy tokens for two prompts, and where its step programs came from.

Usage: python tests/boot_worker.py [MESH]  (its caches: INFIRE_JAX_CACHE; MESH: a mesh-config YAML)
"""

from __future__ import annotations

import json
import sys

from infire_jax.engine.engine import Engine, EngineConfig
from infire_jax.sample.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140))]
# Two token buckets (a decode's and the budget's), not the default six: every kind of step program
# (forward, sampler, decode burst, prompt-logprob gather) is still there, a third as many to compile.
ENGINE = dict(model="dummy:smollm2-135m", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=128, num_kv_pages=32)


def main() -> None:
    engine = Engine(EngineConfig(**ENGINE, mesh=sys.argv[1] if len(sys.argv) > 1 else None))
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))[0]
           for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            logprobs[d.request_id] += [lp[t] for lp, t in zip(d.logprobs or [], d.token_ids)]
    print("RESULT " + json.dumps(dict(
        tokens=[tokens[i] for i in ids], logprobs=[logprobs[i] for i in ids], compiled=engine.boot.compiled,
        executables_loaded=engine.boot.executables_loaded,
        executables_stored=engine.runner.steps.executables.compiled if engine.runner.steps.executables else 0,
        cache_loaded=engine.boot.cache_loaded,
        compiles_since_warmup=engine.compiles_since_warmup)), flush=True)


if __name__ == "__main__":
    main()
