"""Lossless BF16 weight compression: the exponent byte is coded, the sign+mantissa byte kept.

`palette` is the fixed-rate format that stays in device memory and is decoded inside the scanned
layer body (`resident`); `entropy` is the rANS format for disk, decoded once at load. Which weights
are compressed is chosen by kind: `mlp` (the default), `attn`, `embed`.
"""

from __future__ import annotations

from infire_jax.compression.bf16 import BF16, as_bf16, merge_bf16, split_bf16
from infire_jax.compression.entropy import EntropyTensor, decode_entropy, encode_entropy
from infire_jax.compression.palette import PaletteTensor, decode_palette, encode_palette

FORMATS = ("palette", "entropy")
KINDS = {"mlp": ("layers.w_gate_up", "layers.w_down"), "attn": ("layers.wqkv", "layers.wo"),
         "embed": ("embed", "lm_head")}
DEFAULT_KINDS = ("mlp",)


def parse_kinds(spec: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """`"mlp,attn"` (or a sequence) -> the kinds, checked; None -> the default."""
    if spec is None:
        return DEFAULT_KINDS
    kinds = tuple(k.strip() for k in (spec.split(",") if isinstance(spec, str) else spec) if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown tensor kinds {unknown or [spec]}; choose from {sorted(KINDS)}")
    return kinds


def selected(names, kinds: tuple[str, ...]) -> list[str]:
    """The parameter paths among `names` that the kinds select (norms, biases, routers never)."""
    wanted = {n for k in kinds for n in KINDS[k]}
    return [n for n in names if n in wanted]


def kind_of(name: str) -> str | None:
    return next((k for k, names in KINDS.items() if name in names), None)


__all__ = ["BF16", "DEFAULT_KINDS", "EntropyTensor", "FORMATS", "KINDS", "PaletteTensor", "as_bf16",
           "decode_entropy", "decode_palette", "encode_entropy", "encode_palette", "kind_of", "merge_bf16",
           "parse_kinds", "selected", "split_bf16"]
