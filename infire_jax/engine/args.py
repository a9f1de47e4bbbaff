"""The flags every command that runs an engine shares, and what they become.

`infire-jax` (cli.py), `python -m infire_jax.bench` and the server all build engines from the same
command line: the engine's flags as an `EngineConfig`, the sampling flags as `SamplingParams`, the
multi-host flags as a joined process group, and a progress bar for start-up. They live here, below
all three, so that none of them imports another to get them. Building a parser imports no jax.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from infire_jax.engine.vllm_args import add_vllm_engine_args, parallel_mesh
from infire_jax.memplan.sizes import size

if TYPE_CHECKING:
    from infire_jax.engine.engine import EngineConfig
    from infire_jax.sample.sampling_params import SamplingParams

# --max-model-len auto or -1, as vLLM reads them: EngineConfig's max_model_len -1 (the model's context, as
# much of it as a pool sized in advance holds).
AUTO_MODEL_LEN = -1
# The names `kv_scales.resolve_kv_cache_dtype` takes (kept here: building the parser imports no jax).
KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float8_e4m3", "fp8", "fp8_e4m3")


def add_engine_args(p: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    """Flags shared by every command that builds an engine (`several_models`: --model repeats)."""
    p.add_argument("--model", default=None, action="append" if several_models else "store",
                   help="a .gguf file, an HF model directory, or dummy:<name> (default: embedded SmolLM2-135M-Instruct)"
                        + ("; repeat it to serve several models from one process" if several_models else ""))
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weight and KV dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--weights-compression", default=None, metavar="palette[:KINDS]",
                   help="keep weights losslessly palette-compressed on the device, decoded per layer (needs "
                        "--dtype bfloat16); KINDS: mlp (default), attn, e.g. palette:mlp,attn")
    p.add_argument("--weights-quantization", default=None, choices=["gguf", "int8", "fp8", "int4", "checkpoint"],
                   help="keep the layer weights quantized on the device, dequantized per layer inside the layer "
                        "scan (embedding and head stay dense): gguf keeps a GGUF model's Q4_1/Q8_0 blocks; int8 and "
                        "fp8 (e4m3, vLLM's --quantization fp8) quantize a Llama-family, Llama 4, Gemma 3/4, "
                        "GLM-4.5, MiniMax-M2 or Qwen3.5 model at load, one scale per output channel; int4 "
                        "quantizes one at load to AWQ/GPTQ-form int4 (round to nearest, a float16 scale and a "
                        "zero point per group of "
                        "--int4-group-size inputs; a dummy: model's drawn, a DeepSeek/Kimi dummy's routed experts as "
                        "Kimi's int4); checkpoint keeps a published GPTQ/AWQ/FP8/W8A8/DeepSeek-V3/Kimi/gpt-oss "
                        "checkpoint's own int4, 8-bit or MXFP4 "
                        "weights (routed experts dequantized one expert at a time in the grouped matmul)")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="vLLM's flag: the checkpoint's own method (awq, gptq, fp8, compressed-tensors, fbgemm_fp8, "
                        "mxfp4; awq_marlin and gptq_marlin alike) keeps its weights quantized (--weights-quantization "
                        "checkpoint); fp8 on a float model quantizes it at load; gguf keeps a GGUF file's blocks")
    p.add_argument("--int4-group-size", type=int, default=None, choices=[32, 128],
                   help="with --weights-quantization int4: inputs per scale and zero point (default 128; a last "
                        "group is shorter where it does not divide a weight's inputs, as GPTQ's)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s speculative_config, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--max-model-len", type=_model_len, default=None, metavar="N|auto",
                   help="longest prompt + output, in tokens, as vLLM reads it: 4096, 1k (1000), 1K (1024), 25.6k, "
                        "2m, 2M; auto or -1: the model's own context, capped where the KV pool is sized in "
                        "advance (--num-kv-pages, --kv-cache-memory-bytes, CPU) to what it holds for one "
                        "sequence (default: the model's context, at most 8192)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=size, default=None, metavar="N",
                   help="token budget of one step (1k, 2K as --max-model-len)")
    p.add_argument("--token-buckets", type=int, nargs="+", default=None, metavar="N",
                   help="the step sizes compiled, in tokens: increasing, the last = --max-num-batched-tokens; "
                        "each step is padded to the smallest that holds it. Fewer compile faster at start-up, "
                        "more pad less (as vLLM's --cuda-graph-sizes). Default: powers of two up to the budget")
    p.add_argument("--num-decode-steps", type=int, default=4,
                   help="decode steps a step of decodes alone may run in one device launch, read back once "
                        "(1: one step a launch; tokens then stream one at a time). Default 4")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="dtype of the KV cache: auto (the model's), bfloat16, float32, or float8_e4m3 (aliases fp8, "
                        "fp8_e4m3): e4m3 pages with per-(layer, kv head) scales, twice the tokens of bfloat16; the "
                        "scales are an HF checkpoint's k_scale / v_scale where it has them, else calibrated")
    p.add_argument("--calibrate-kv-scales", action="store_true",
                   help="fp8 KV cache: calibrate the scales even when the checkpoint carries k_scale / v_scale")
    p.add_argument("--num-kv-pages", "--num-gpu-blocks-override", type=int, default=None,
                   help="size of the KV pool in pages (overrides memory; vLLM's --num-gpu-blocks-override)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of equal prompt prefixes across requests (vLLM's flag; on by default)")
    p.add_argument("--linear-state-snapshots", type=int, default=None, metavar="N",
                   help="models with linear-attention layers (Qwen3.5): copies of a sequence's state the prefix "
                        "cache keeps on the device (default min(16, --max-num-seqs); 0 turns prefix caching off)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of each GPU's memory for weights, activations and the KV pool (default 0.90)")
    p.add_argument("--attention", default="auto", dest="attn_impl",
                   help="attention implementation: auto (pallas on GPU, else reference), reference, pallas, "
                        "or pallas_interpret (the Pallas kernels in interpret mode, for checking on CPU)")
    p.add_argument("--max-prompt-logprobs", type=int, default=None,
                   help="most top alternatives a prompt token's logprobs may ask for (prompt_logprobs; on "
                        "/v1/completions, logprobs with echo); more is a 400 (default --max-logprobs, else 20)")
    p.add_argument("--runner", default="generate", choices=("generate", "pooling"),
                   help="vLLM's flag: pooling also serves embeddings (POST /v1/embeddings, LLM.embed), a prompt's "
                        "final hidden states pooled; the model still generates (default generate)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help="with --runner pooling: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"use_activation\": "
                        "bool, \"matryoshka_dimensions\": [sizes] or true} over what the checkpoint declares "
                        "(sentence-transformers files); default LAST, normalized")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests that bring none")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="vLLM's flag: the sampling defaults (temperature, top_p, top_k, min_p, "
                        "repetition_penalty; max_new_tokens caps max_tokens) a request that leaves them unset "
                        "gets: auto, the model folder's generation_config.json; vllm, none; or a folder's")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="vLLM's flag: fields laid over the generation config, e.g. '{\"temperature\": 0.5}'")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="longest a structured-output grammar may take to compile; longer is a 400 (default 10)")
    p.add_argument("--mesh", default=None,
                   help="mesh-config YAML (default: -tp/-pp's mesh, else the shipped file for the number of devices)")
    add_vllm_engine_args(p)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format) over the model, many in one batch (infire_jax/lora/)")
    p.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters in device slots at once, so in one step (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest LoRA rank served; every slot is padded to it (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="loaded LoRA adapters kept in host memory, least recently used first out "
                        "(default: --max-loras; at least that)")
    p.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None, metavar="image=N",
                   help="images a prompt may carry, vLLM's flag as image=N or JSON {\"image\": N} (default 1 "
                        "where the checkpoint has a vision tower; 0 serves text only)")
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0's coordinator (env INFIRE_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's id")


def _model_len(text: str) -> int:
    """--max-model-len: a size, or auto / -1 (AUTO_MODEL_LEN)."""
    return AUTO_MODEL_LEN if text.strip() in ("auto", "-1") else size(text)


def _mm_limits(text: str) -> dict[str, int]:
    """`image=2` or `{"image": 2}` -> {"image": 2}."""
    import json

    try:
        limits = json.loads(text) if text.lstrip().startswith("{") else {
            k.strip(): int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item.strip())}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt {text!r}: expected image=N or {{\"image\": N}}") from e
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt {text!r}: expected image=N or {{\"image\": N}}")
    return limits


def engine_config(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """The engine settings of the flags, for `model` when given (else --model)."""
    from infire_jax.engine.engine import EngineConfig
    from infire_jax.sample.sampling_params import MAX_LOGPROBS

    max_logprobs = MAX_LOGPROBS if args.max_logprobs is None else args.max_logprobs
    return EngineConfig(model=model or args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
                        num_kv_pages=args.num_kv_pages, kv_cache_memory=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching,
                        linear_state_snapshots=args.linear_state_snapshots,
                        attn_impl=args.attn_impl, kv_cache_dtype=args.kv_cache_dtype,
                        calibrate_kv_scales=args.calibrate_kv_scales, mesh=parallel_mesh(args), seed=args.seed,
                        page_size=args.block_size,
                        weights_compression=args.weights_compression,
                        weights_quantization=args.weights_quantization, quantization=args.quantization,
                        int4_group_size=args.int4_group_size,
                        speculative_config=args.speculative_config,
                        grammar_compile_timeout=args.grammar_compile_timeout, num_decode_steps=args.num_decode_steps,
                        generation_config=args.generation_config,
                        override_generation_config=args.override_generation_config,
                        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras,
                        max_prompt_logprobs=max_logprobs if args.max_prompt_logprobs is None
                        else args.max_prompt_logprobs, max_logprobs=min(max_logprobs, MAX_LOGPROBS),
                        limit_mm_per_prompt=args.limit_mm_per_prompt,
                        runner=args.runner, pooler_config=args.pooler_config)


def init_distributed(args: argparse.Namespace) -> bool:
    """Joins a multi-host group when asked to; returns whether this process must only follow."""
    import jax

    from sharding.distributed import initialize

    return initialize(args.coordinator_address, args.num_processes, args.process_id) and jax.process_index() != 0


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Flags of the sampling of a command's own requests (generate, chat)."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling settings of the flags of add_sampling_args."""
    from infire_jax.sample.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def progress_bar():
    """A tqdm bar per stage (load, compile) for engine start-up."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def report(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=stage, unit="step" if stage == "compile" else "model",
                                     leave=False, file=sys.stderr)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return report
