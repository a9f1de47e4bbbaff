"""`bench spec`: batch-1 decode speed with speculative decoding, against the same engine without it.

Two workloads of chat requests, one at a time: `grounded` asks the model to repeat or edit a
given text (its output copies its input, where prompt lookup shines), `chat` asks open questions
(little to copy). Each request runs once unmeasured, then --repeats times on each engine, greedy
with --max-tokens. It reports output tokens/s (generated tokens over the wall time of the request,
prefill included, as a user sees it), the speed-up, and the mean acceptance length: tokens each
verifying step produced (accepted proposals + 1). It also reports how many requests gave the
same greedy output with and without speculation: in float32 all of them (tests/test_speculative.py
checks it); in bfloat16 a k+1-token forward may round differently from a one-token forward, as in
any batched engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from infire_jax.bench.common import BenchError, positive_int
from infire_jax.engine.args import add_engine_args, engine_config

DESCRIPTION = __doc__.split("\n\n", 1)[1]

_TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
         "the members agreed to fund the children's reading room, to repair the roof before the winter, "
         "and to extend the opening hours on weekends. The chair thanked the volunteers who had collected "
         "more than two thousand books, and asked the city to publish the final plan by the end of the month.")
WORKLOADS = {
    "grounded": [
        f"Repeat the following text exactly, word for word:\n\n{_TEXT}",
        f"Rewrite the following text, replacing 'library' with 'museum' and changing nothing else:\n\n{_TEXT}",
        f"Copy this paragraph and put it in quotation marks:\n\n{_TEXT}",
    ],
    "chat": [
        "Tell me about the history of Rome.",
        "What are some good habits for staying healthy?",
        "Explain how a rainbow forms.",
    ],
}
COLUMNS = [
    ("workload", "workload", "{}"), ("requests", "requests", "{}"), ("tokens", "tokens", "{}"),
    ("base_tok_s", "no spec tok/s", "{:.1f}"), ("spec_tok_s", "spec tok/s", "{:.1f}"),
    ("speedup", "speed-up", "{:.2f}x"), ("acceptance_length", "acceptance length", "{:.2f}"),
    ("drafted_steps", "verifying steps", "{}"), ("identical", "same output", "{}"),
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), action="append", default=None,
                   help="repeat for several (default: both)")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=2, help="measured runs of each request per engine")
    add_engine_args(p)
    p.set_defaults(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')


def _run(llm, prompt: str, params) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
    return out.token_ids, time.perf_counter() - start


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import settings
    from infire_jax.engine.engine import Engine
    from infire_jax.llm import LLM
    from infire_jax.sample.sampling_params import SamplingParams

    spec_config = json.loads(args.speculative_config)
    base = LLM(engine=Engine(dataclasses.replace(engine_config(args), speculative_config=None, max_num_seqs=1)))
    spec = LLM(engine=Engine(dataclasses.replace(engine_config(args), max_num_seqs=1)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows = []
    for workload in args.workload or sorted(WORKLOADS):
        totals = {"base": [0, 0.0], "spec": [0, 0.0]}
        stats = spec.engine.spec.stats
        drafts0, accepted0 = stats.num_drafts, stats.num_accepted_tokens
        identical = 0
        for prompt in WORKLOADS[workload]:
            identical += _run(base, prompt, params)[0] == _run(spec, prompt, params)[0]
            for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
                for name, llm in (("base", base), ("spec", spec)):
                    tokens, seconds = _run(llm, prompt, params)
                    totals[name][0] += len(tokens)
                    totals[name][1] += seconds
        drafts = stats.num_drafts - drafts0
        base_rate, spec_rate = (totals[n][0] / totals[n][1] for n in ("base", "spec"))
        rows.append(dict(workload=workload, requests=len(WORKLOADS[workload]) * args.repeats,
                         tokens=totals["spec"][0], base_tok_s=base_rate, spec_tok_s=spec_rate,
                         speedup=spec_rate / base_rate, drafted_steps=drafts,
                         identical=f"{identical}/{len(WORKLOADS[workload])}",
                         acceptance_length=1 + (stats.num_accepted_tokens - accepted0) / drafts if drafts else None))
    if base.engine.compiles_since_warmup or spec.engine.compiles_since_warmup:
        raise BenchError("the engines compiled after warmup")
    payload = dict(benchmark="spec", settings=settings(args), speculative_config=spec_config, results=rows)
    title = f"speculative decoding at batch 1: {spec_config}"
    return report.Result(payload, report.table(rows, COLUMNS), [], title)
