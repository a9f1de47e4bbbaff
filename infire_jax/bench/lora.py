"""`--lora N` of `bench latency` and `bench throughput`: the same workload on the base model and on N
random LoRA adapters of rank `--lora-rank` (one per row, round-robin), in one run, so each LoRA
figure comes with its ratio to the base model's on the same machine at the same time.

The base model runs on an engine without LoRA (the program it would have without `--enable-lora`),
then a LoRA engine with `--max-loras N` runs the adapters, registered from memory (random A and B
of PEFT's shapes, scale 1), never read from disk.
"""

from __future__ import annotations

import argparse
import gc
from typing import Iterator

from infire_jax.bench.common import int_at_least, positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", type=int_at_least(0), default=0, metavar="N",
                   help="also run N random LoRA adapters (one per row, round-robin) on an engine with "
                        "--enable-lora --max-loras N, after the base model, and report each figure's ratio to it")
    p.add_argument("--lora-rank", type=positive_int, default=16, help="rank of the --lora adapters (default 16)")


def random_adapters(engine, n: int, rank: int, seed: int = 0) -> list[str]:
    """Registers n random adapters adapting every module the model has; returns their names."""
    import numpy as np

    from infire_jax.lora.peft import PeftAdapter, model_modules
    from infire_jax.lora.request import LoRARequest

    rng = np.random.default_rng(seed)
    known = model_modules(engine.model_config)
    names = []
    for i in range(n):
        modules = {}
        for layer in range(engine.model_config.num_layers):
            for m, (_, fan_in, fan_out) in known.items():
                if m in ("qkv_proj", "gate_up_proj"):
                    continue  # their members are there
                modules[layer, m] = (rng.normal(0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32),
                                     rng.normal(0, 0.01, (fan_out, rank)).astype(np.float32))
        name = f"bench-lora-{i}"
        engine.lora.register(LoRARequest(name, i + 1, ""), PeftAdapter("", rank, 1.0, modules, f"bench-{seed}-{i}"))
        names.append(name)
    return names


def engines(args: argparse.Namespace, max_num_seqs: int) -> Iterator[tuple[str, object, object, list[str] | None]]:
    """(variant, engine, device peaks, adapter names or None): the base model, then with --lora N the
    LoRA engine; each engine is closed and dropped before the next is built."""
    from infire_jax.bench.common import start_engine

    variants = [("base", args)]
    if args.lora:
        variants.append((f"lora={args.lora} r={args.lora_rank}",
                         argparse.Namespace(**{**vars(args), "enable_lora": True, "max_loras": args.lora,
                                               "max_lora_rank": args.lora_rank, "max_cpu_loras": None})))
    elif args.enable_lora:
        variants = [("lora", args)]
    for variant, flags in variants:
        engine, peaks = start_engine(flags, max_num_seqs)
        loras = random_adapters(engine, args.lora, args.lora_rank, args.seed) if variant.startswith("lora=") else None
        try:
            yield variant, engine, peaks, loras
        finally:
            engine.close()
            del engine
            gc.collect()


def with_ratios(results: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Each LoRA row gets `<key>_vs_base`: its figure over the base row of the same label."""
    base = {r["label"]: r for r in results if r["variant"] == "base"}
    out = []
    for r in results:
        twin = base.get(r["label"]) if r["variant"] != "base" else None
        ratios = {f"{k}_vs_base": r[k] / twin[k] for k in keys if twin is not None and twin[k]}
        out.append({**r, **ratios})
    return out
