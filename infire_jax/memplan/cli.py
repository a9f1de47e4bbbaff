"""`infire-jax plan`: the flags and the command."""

from __future__ import annotations

import argparse

from infire_jax.memplan.sizes import size


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from infire_jax.memplan.source import shipped_configs

    p.add_argument("--model", default=None,
                   help=f"a shipped config ({', '.join(shipped_configs())}; also as dummy:NAME), an HF config.json "
                        "or its directory, or any model spec (only its config is read)")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    p.add_argument("--device-memory", required=True, help="memory of one device, e.g. 80GiB")
    p.add_argument("--mesh", default=None,
                   help="mesh-config YAML (default: the shipped mesh for --devices that leaves the most KV tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of unquantized weights and activations (default bfloat16)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16", "float32", "float8_e4m3", "fp8", "fp8_e4m3"],
                   help="KV cache dtype (default: --dtype); fp8 and fp8_e4m3 mean float8_e4m3")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of each device for weights, activations and KV, as the engine's (default 0.90)")
    p.add_argument("--max-num-batched-tokens", type=size, default=8192, metavar="N",
                   help="tokens of the largest step, for the activation estimate (the GPU default, 8192; "
                        "as serve's: 8k is 8000, 8K 8192)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="rows sampled per step (logits estimate)")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens a KV page holds, as the engine's page_size (default 16): a hybrid KV cache's "
                        "chunked / window layers hold whole pages")
    p.add_argument("--weights-quantization", default=None, choices=["int8", "fp8", "int4"],
                   help="the layer weights as the engine's --weights-quantization int8, fp8 or int4 quantizes them at "
                        "load (GPTQ / AWQ, 8-bit, DeepSeek-V3 and Kimi configs are planned as their checkpoints are "
                        "kept)")
    p.add_argument("--int4-group-size", type=int, default=None, choices=[32, 128],
                   help="with --weights-quantization int4: inputs per scale and zero point (default 128)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative_config, as serve's: an EAGLE-3 head (its directory's config) or the "
                        "model's MTP layer, placed as the engine places it, and its one-layer pool")
    p.add_argument("--dequant", default="per-layer", choices=["per-layer", "fused"],
                   help="per-layer: the layer scan dequantizes one layer's dense weights, the grouped matmul one "
                        "routed expert at a time (the XLA path: a workspace of one layer's dense weights and one "
                        "expert); fused: the GPU's Pallas kernels dequantize on chip (routed experts always, dense "
                        "weights in decode-sized steps: a workspace of one layer's dense weights)")


def run_plan(args: argparse.Namespace, draft_head_for) -> int:
    """`draft_head_for(speculative_config, dtype)`: the speculation layer's (speculative/plan.py), which the
    command passes in (this layer sits below it)."""
    from infire_jax.errors import ConfigError
    from infire_jax.memplan.plan import best_plan, memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import MeshConfig, MeshConfigError

    try:
        if args.devices < 1:
            raise ValueError(f"--devices must be positive, got {args.devices}")
        if args.page_size < 1:
            raise ValueError(f"--page-size must be positive, got {args.page_size}")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        memory = parse_bytes(args.device_memory)
        draft = draft_head_for(args.speculative_config, args.dtype) if args.speculative_config else None
        model_for = plan_source(args.model, args.dtype, args.weights_quantization, args.int4_group_size, draft)
        kv_dtype = "float8_e4m3" if args.kv_cache_dtype in ("fp8", "fp8_e4m3") else args.kv_cache_dtype
        kw = dict(dtype=args.dtype, kv_dtype=kv_dtype, utilization=args.gpu_memory_utilization,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  dequant=args.dequant, page_size=args.page_size)
        if args.mesh:
            mc = MeshConfig.from_yaml(args.mesh)
            mc.check_devices(args.devices)
            plan = memory_plan(model_for(mc), mc, memory, **kw)
        else:
            plan = best_plan(model_for, args.devices, memory, **kw)
    except (ValueError, MeshConfigError) as e:
        raise ConfigError(str(e)) from e
    print(plan.describe())
    return 0
