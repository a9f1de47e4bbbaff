"""The vLLM side of `bench compare`: runs in vLLM's own Python, so it imports only vllm and the stdlib.

Reads one JSON request on stdin: {"model": HF dir, "eager": bool, "work": {...}}, where the work is
what `bench compare` also runs on our engine: dtype, max_model_len, prompt_ids, prefill_ids,
batch_sizes, new_tokens, reps (and embed_inputs copies of embed_ids to embed, on a second LLM with
the pooling runner); or what `bench perplexity` scores: dtype, kv_cache_dtype,
max_model_len, windows (token ids) and first (each window's first scored position).
Prints one JSON line on stdout with the same figures as our side (vLLM's logs go to stderr).
Prefix caching is off: every run repeats the same prompt.
Env knobs, set here unless the caller's environment sets them: VLLM_CPU_KVCACHE_SPACE=2 (GiB),
VLLM_CACHE_ROOT under the infire_jax cache (its torch.compile cache), VLLM_LOGGING_STREAM=stderr.
"""

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CACHE_ROOT": os.path.join(
        os.environ.get("INFIRE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "infire_jax")), "vllm"),
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def timed(generate, reps):
    """One untimed warm-up, then `reps` timed calls: (seconds of each, the last call's outputs)."""
    generate()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        outputs = generate()
        seconds.append(time.perf_counter() - start)
    return seconds, outputs


def measure(llm, work):
    from vllm import SamplingParams

    n = work["new_tokens"]
    forced = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    res = {"e2e": {}}
    for b in work["batch_sizes"]:
        prompts = [{"prompt_token_ids": work["prompt_ids"]} for _ in range(b)]
        seconds, outs = timed(lambda: llm.generate(prompts, forced, use_tqdm=False), work["reps"])
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res["e2e"][f"b{b}"] = {"seconds": seconds, "median_s": statistics.median(seconds),
                               "new_tokens": tokens, "tok_s": tokens / statistics.median(seconds)}
        if b == 1:
            res["token_ids_b1"], res["text_b1"] = list(outs[0].outputs[0].token_ids), outs[0].outputs[0].text
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [{"prompt_token_ids": work["prefill_ids"]}]
    seconds, _ = timed(lambda: llm.generate(prompt, one, use_tqdm=False), work["reps"])
    res["prefill"] = {"len": len(work["prefill_ids"]), "seconds": seconds, "median_s": statistics.median(seconds),
                      "tok_s": len(work["prefill_ids"]) / statistics.median(seconds)}
    return res


def embed(request, work):
    """The pooling runner's time to embed `embed_inputs` copies of `embed_ids` (last token, normalised)."""
    import vllm
    from vllm.config import PoolerConfig

    llm = vllm.LLM(model=request["model"], runner="pooling", dtype=work["dtype"], max_model_len=work["max_model_len"],
                   seed=0, enable_prefix_caching=False, enforce_eager=request["eager"],
                   pooler_config=PoolerConfig(pooling_type="LAST", use_activation=True))
    prompts = [{"prompt_token_ids": work["embed_ids"]}] * work["embed_inputs"]
    seconds, outs = timed(lambda: llm.embed(prompts, use_tqdm=False), work["reps"])
    median = statistics.median(seconds)
    return {"seconds": seconds, "median_s": median, "inputs_s": work["embed_inputs"] / median,
            "tok_s": work["embed_inputs"] * len(work["embed_ids"]) / median,
            "first": list(outs[0].outputs.embedding)}


def perplexity(llm, work):
    """The summed negative log-likelihood of each window's positions from its `first` on (its prompt
    logprobs; vLLM generates at least one token, which is not scored), and their count."""
    from vllm import SamplingParams

    start = time.perf_counter()
    prompts = [{"prompt_token_ids": ids} for ids in work["windows"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for ids, first, out in zip(work["windows"], work["first"], outs):
        nll -= sum(out.prompt_logprobs[pos][ids[pos]].logprob for pos in range(first, len(ids)))
        count += len(ids) - first
    return {"nll": nll, "tokens": count, "seconds": time.perf_counter() - start}


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    request = json.load(sys.stdin)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import vllm

    work = request["work"]
    start = time.perf_counter()
    llm = vllm.LLM(model=request["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0,
                   enable_prefix_caching=False, enforce_eager=request["eager"],
                   kv_cache_dtype=work.get("kv_cache_dtype", "auto"))
    res = {"peer": "vllm", "load_s": time.perf_counter() - start, "work": work, "model": request["model"],
           "eager": request["eager"], "env": {k: os.environ[k] for k in ENV_DEFAULTS},
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
           "versions": {"vllm": vllm.__version__, "torch": importlib.metadata.version("torch"),
                        "python": platform.python_version()}}
    res.update(perplexity(llm, work) if "windows" in work else measure(llm, work))
    if work.get("embed_inputs"):
        del llm  # its engine process ends before the pooling one starts
        gc.collect()
        res["embed"] = embed(request, work)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
