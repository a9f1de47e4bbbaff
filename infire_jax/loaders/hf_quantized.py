"""Published quantized HF checkpoints, read by the HF loader (issue 14).

`config.json`'s `quantization_config` schemes: two the DeepSeek-V3 family ships,

- `compressed-tensors` with `format: pack-quantized`, 4-bit symmetric integer weights, one scale
  per `group_size` inputs (Kimi K2 / K2.5's routed experts): a module's `weight_packed`,
  `weight_scale` and `weight_shape` become its `weight`.
- `fp8` with `weight_block_size` [B, B] and `fmt: e4m3` (DeepSeek-V3; MiniMax-M2 writes
  `float8_e4m3fn`): a float8_e4m3fn `weight` and its `weight_scale_inv` become the `weight`.

the 8-bit schemes Llama / Qwen / Mistral checkpoints for vLLM are most often published in, each
an `[out, in]` 8-bit `weight` and a `weight_scale` per output channel or per tensor (a tensor's
scale is repeated on its rows; `w = float32(q) * scale[o]`):

- `compressed-tensors` with `format: float-quantized` (llm-compressor's FP8 and FP8-dynamic) or
  `int-quantized` (its W8A8 int8): symmetric 8-bit weights, `strategy` channel or tensor; or its
  FP8_BLOCK, `strategy: block` with a square `block_structure`: DeepSeek-V3's fp8 blocks, the scale
  named `weight_scale`;
- `fp8` without `weight_block_size` (AutoFP8, vLLM's own fp8 serialization): one scale a tensor;
- `fbgemm_fp8` (Meta's Llama 3.1 FP8): one scale a channel.

Their activation scales (`input_scale`, `input_scale_ub`, `input_zero_point`) are dropped: the
engine multiplies the serving dtype's activations by the 8-bit weights (weight-only, W8A16), so
its outputs stay nearer the float model's than a W8A8 kernel's.

and the two int4 schemes of the same families (quant/gptq_awq.py has the formats):

- `gptq`, 4-bit: a module's `qweight`, `qzeros`, `scales` and `g_idx` (act-order too), any group
  size tiling the inputs or -1, symmetric or not, `checkpoint_format` gptq (v1) or gptq_v2.
- `awq` with `version: gemm` and zero points (AutoAWQ): `qweight`, `qzeros` and `scales`.

A compressed-tensors config with a `kv_cache_scheme` (fp8) and no weight groups is a float
checkpoint with KV-cache scales (loaders/kv_scales_hf.py reads them).

By default the weights are dequantized here (`dequantized`), exactly as the formats define
(quant/formats.py, checked bit for bit against float64 definitions in tests), and the rest of the
loader sees a float checkpoint. With `weights_quantization="checkpoint"` the quantized layer
weights stay quantized on the device instead: `kept_parts` gives a DeepSeek-V3-family module's
checked parts and loaders/deepseek_quant.py places them (quant/grouped.py); `unpack_module` a GPTQ
/ AWQ one's, placed by loaders/llama_quant.py. Tensors the scheme leaves alone (norms, the router,
layers on the scheme's ignore list or `modules_to_not_convert`) pass through.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.quant import gptq_awq
from infire_jax.quant.formats import Fp8Block, Fp8Channel, Int4Group, Int8Channel, dequantize

# Each scheme's tensors of one quantized module
PARTS = {"int4": ("weight_packed", "weight_scale", "weight_shape"), "fp8": ("weight", "weight_scale_inv"),
         "channel": ("weight", "weight_scale"),
         "gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
# An 8-bit scheme's activation tensors, dropped (weight-only: see the module doc)
ACTIVATION_PARTS = ("input_scale", "input_scale_ub", "input_zero_point")
CHANNEL_VALUES = {"float": ml_dtypes.float8_e4m3fn, "int": np.int8}  # compressed-tensors' weight types
E4M3_NAMES = ("e4m3", "float8_e4m3fn")  # an fp8 config's `fmt` for e4m3 weights


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    kind: str  # "int4" (compressed-tensors pack-quantized), "fp8" (block scales), "channel", "gptq" or "awq"
    group: int = 0  # int4, gptq, awq: inputs per scale (gptq, awq: -1 for one group per row)
    block: int = 0  # fp8: rows and columns per scale
    zero_offset: int = 0  # gptq v1 stores each zero minus this
    act_order: bool = False  # gptq desc_act with groups: any input may be in any group (kept with its g_idx)
    values: Any = None  # channel: the weight's dtype (float8_e4m3fn or int8)
    block_scale: str = "weight_scale_inv"  # fp8: the checkpoint's name of the block scales (compressed-tensors')


def _bad(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config.{field} = {value!r}: {why}")


def quantization_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's `quantization_config` (Kimi K2.5 may nest it in `text_config`); {} for a float one."""
    return dict(hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or {})


# The schemes loaders/llama_quant.py keeps on a Llama-family model, and those whose MoE experts
# (Mixtral, Qwen3-MoE) it keeps too: 8-bit values a scale a row (and block).
GQA_KEPT_KINDS = ("gptq", "awq", "channel", "fp8")
GQA_EXPERT_KINDS = ("channel", "fp8")


def gqa_kept_scheme(hf: Mapping[str, Any]) -> QuantScheme | None:
    """The scheme of a config whose layer weights loaders/llama_quant.py keeps (GPTQ / AWQ, 8-bit
    channels, fp8 blocks but on the DeepSeek-V3 family's MLA models, which loaders/deepseek_quant.py
    keeps); None for any other (gpt-oss's MXFP4 included)."""
    if quantization_config(hf).get("quant_method") in (None, "mxfp4"):
        return None
    scheme = quant_scheme(hf)
    mla = bool((hf.get("text_config") or hf).get("kv_lora_rank"))
    if scheme is None or scheme.kind not in GQA_KEPT_KINDS or (scheme.kind == "fp8" and mla):
        return None
    return scheme


def quant_scheme(hf: Mapping[str, Any]) -> QuantScheme | None:
    """The scheme of a config.json (`quantization_config`); None for a float checkpoint,
    UnsupportedModelError naming the field for one this loader cannot read."""
    qc = quantization_config(hf)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fbgemm_fp8" or (method == "fp8" and qc.get("weight_block_size") is None):
        return QuantScheme("channel", values=ml_dtypes.float8_e4m3fn)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
            raise _bad("weight_block_size", block, "square [B, B] block scales are supported")
        if qc.get("fmt", "e4m3") not in E4M3_NAMES:  # DeepSeek-V3 writes "e4m3", MiniMax-M2 the torch dtype's name
            raise _bad("fmt", qc.get("fmt"), "only e4m3 fp8 weights are supported")
        return QuantScheme("fp8", block=int(block[0]))
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        kv = qc.get("kv_cache_scheme")
        if kv and (kv.get("type"), kv.get("num_bits")) != ("float", 8):
            raise _bad("kv_cache_scheme", kv, "only fp8 (type float, 8 bits) KV-cache scales are read")
        if kv and not groups:  # float weights beside fp8 KV-cache scales (loaders/kv_scales_hf.py)
            return None
        if len(groups) != 1:
            raise _bad("config_groups", list(groups), "exactly one quantization group is supported")
        name, group = next(iter(groups.items()))
        fmt = group.get("format") or qc.get("format")
        if fmt in ("float-quantized", "int-quantized"):
            return _channel_scheme(name, group, fmt)
        if fmt != "pack-quantized":
            raise _bad(f"config_groups.{name}.format", fmt,
                       "supported: pack-quantized, float-quantized, int-quantized")
        w = group.get("weights") or {}
        want = dict(num_bits=4, type="int", symmetric=True, strategy="group")
        for key, value in want.items():
            if w.get(key) != value:
                raise _bad(f"config_groups.{name}.weights.{key}", w.get(key), f"supported: {value!r}")
        if group.get("input_activations"):
            raise _bad(f"config_groups.{name}.input_activations", group["input_activations"],
                       "only weight-only quantization is supported")
        size = w.get("group_size")
        if not isinstance(size, int) or size <= 0 or size % 8:
            raise _bad(f"config_groups.{name}.weights.group_size", size, "a positive multiple of 8 is supported")
        return QuantScheme("int4", group=size)
    if method in ("gptq", "awq"):
        return _int4_zero_scheme(method, qc)
    raise _bad("quant_method", method, "supported: compressed-tensors (pack-quantized int4, float- or "
               "int-quantized 8-bit), fp8, fbgemm_fp8, gptq (4-bit), awq (4-bit gemm)")


def _channel_scheme(name: str, group: Mapping[str, Any], fmt: str) -> QuantScheme:
    """A compressed-tensors 8-bit group (see the module doc); what would decode differently is refused
    by its field."""
    w = group.get("weights") or {}
    kind = "float" if fmt == "float-quantized" else "int"
    for key, want in dict(num_bits=8, type=kind, symmetric=True).items():
        if w.get(key) != want:
            raise _bad(f"config_groups.{name}.weights.{key}", w.get(key), f"{fmt} weights: supported {want!r}")
    strategies = ("channel", "tensor", "block") if kind == "float" else ("channel", "tensor")
    if w.get("strategy") not in strategies:
        raise _bad(f"config_groups.{name}.weights.strategy", w.get("strategy"),
                   f"{fmt} weights: supported {', '.join(map(repr, strategies))}")
    if w.get("dynamic"):
        raise _bad(f"config_groups.{name}.weights.dynamic", True, "weights must carry their scales")
    if w["strategy"] == "block":  # llm-compressor's FP8_BLOCK: DeepSeek-V3's blocks, the scale as `weight_scale`
        block = w.get("block_structure")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and block[0] == block[1]
                and isinstance(block[0], int) and block[0] > 0):
            raise _bad(f"config_groups.{name}.weights.block_structure", block, "square [B, B] blocks are supported")
        return QuantScheme("fp8", block=block[0], block_scale="weight_scale")
    return QuantScheme("channel", values=CHANNEL_VALUES[kind])


def _int4_zero_scheme(method: str, qc: Mapping[str, Any]) -> QuantScheme:
    """GPTQ or AWQ (see the module doc); what would decode differently is refused by its field."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _bad("bits", bits, f"only 4-bit {method} is supported")
    size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(size, int) or not (size == -1 or size > 0):
        raise _bad("group_size", size, "a positive group size or -1 is supported")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _bad("version", qc.get("version"), "only AWQ's gemm packing is supported")
        if qc.get("zero_point", True) is not True:
            raise _bad("zero_point", qc.get("zero_point"), "only AWQ with zero points is supported")
        if qc.get("backend", "autoawq") != "autoawq":
            raise _bad("backend", qc.get("backend"), "only AutoAWQ's packing is supported")
        return QuantScheme("awq", group=size)
    if qc.get("is_marlin_format"):
        raise _bad("is_marlin_format", True, "marlin-packed GPTQ is not supported")
    fmt = qc.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _bad("checkpoint_format", fmt, "supported: gptq, gptq_v2")
    return QuantScheme("gptq", group=size, zero_offset=1 if fmt == "gptq" else 0,
                       act_order=bool(qc.get("desc_act")) and size != -1)  # one group per row: order is moot


def _split(name: str, parts: tuple[str, ...]) -> tuple[str, str] | None:
    module, _, part = name.rpartition(".")
    return (module, part) if part in parts else None


def _to_host(w) -> np.ndarray:
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(dequantize(w))


def unpack_module(module: str, parts: dict[str, np.ndarray], scheme: QuantScheme) -> gptq_awq.Int4Zero:
    """A GPTQ / AWQ module's tensors, checked and unpacked; UnsupportedModelError naming the tensor."""
    try:
        if scheme.kind == "gptq":
            return gptq_awq.unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"],
                                        scheme.group, scheme.zero_offset)
        return gptq_awq.unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], scheme.group)
    except (ValueError, TypeError) as e:
        raise UnsupportedModelError(f"{module}: {e}") from e


def channel_parts(module: str, parts: dict[str, np.ndarray], scheme: QuantScheme) -> Int8Channel | Fp8Channel:
    """An 8-bit module's weight and its scale per output channel `[O, 1]` (a tensor's one scale repeated
    on every row), checked; UnsupportedModelError naming the tensor."""
    weight, scale = parts["weight"], np.asarray(parts["weight_scale"])
    out = weight.shape[0] if weight.ndim == 2 else -1
    if scale.size == 1:
        scale = np.full((out, 1), scale.reshape(()), scale.dtype)
    elif scale.shape in ((out,), (out, 1)):
        scale = scale.reshape(out, 1)
    else:
        raise UnsupportedModelError(f"{module}.weight_scale has shape {scale.shape}: expected one scale a tensor "
                                    f"or one a row ({out}) of weight {weight.shape}")
    try:
        form = Fp8Channel if scheme.values == ml_dtypes.float8_e4m3fn else Int8Channel
        return form(weight, scale)
    except (ValueError, TypeError) as e:
        raise UnsupportedModelError(f"{module}: {e}") from e


def dequantize_module(module: str, parts: dict[str, np.ndarray], scheme: QuantScheme) -> np.ndarray:
    if scheme.kind in ("gptq", "awq"):
        return gptq_awq.dequantize(unpack_module(module, parts, scheme))
    if scheme.kind == "channel":
        return _to_host(channel_parts(module, parts, scheme))
    try:
        if scheme.kind == "int4":
            shape = tuple(int(n) for n in np.asarray(parts["weight_shape"]).reshape(-1))
            return _to_host(Int4Group(parts["weight_packed"], parts["weight_scale"], shape, scheme.group))
        return _to_host(Fp8Block(parts["weight"], parts["weight_scale_inv"].astype(np.float32), scheme.block))
    except (ValueError, TypeError) as e:
        raise UnsupportedModelError(f"{module}: {e}") from e


def kept_parts(module: str, parts: dict[str, np.ndarray], scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """One module's (values, scale), checked as the format checks them, in HF's `[out, in / k]`
    layout: int4 words `[O, I / 8]` and scales `[O, I / group]`; fp8 values `[O, I]` and each block's
    scale repeated on its output rows, `[O, ceil(I / block)]` (quant/grouped.py)."""
    try:
        if scheme.kind == "int4":
            shape = tuple(int(n) for n in np.asarray(parts["weight_shape"]).reshape(-1))
            Int4Group(parts["weight_packed"], parts["weight_scale"], shape, scheme.group)
            return parts["weight_packed"], parts["weight_scale"]
        scale = parts["weight_scale_inv"].astype(np.float32)
        Fp8Block(parts["weight"], scale, scheme.block)
        return parts["weight"], np.repeat(scale, scheme.block, axis=0)[:parts["weight"].shape[0]]
    except (ValueError, TypeError) as e:
        raise UnsupportedModelError(f"{module}: {e}") from e


def grouped(tensors: Iterable[tuple[str, np.ndarray]], scheme: QuantScheme
            ) -> Iterator[tuple[str, np.ndarray | dict[str, np.ndarray]]]:
    """The checkpoint's tensors with each quantized module's parts gathered: (name, array) for a
    tensor the scheme leaves alone, (module, {part: array}) once all of a module's parts are read
    (they may arrive in any order, across files)."""
    names = PARTS[scheme.kind]
    # the checkpoint's names of the parts (fp8 blocks: compressed-tensors calls the scale `weight_scale`)
    stored = {"weight_scale_inv": scheme.block_scale} if scheme.kind == "fp8" else {}
    as_stored = tuple(stored.get(n, n) for n in names)
    # fp8 and 8-bit: only weights of the quantized dtype are (norms, the router, the embedding and the
    # modules the config leaves out stay as they are)
    values = {"fp8": ml_dtypes.float8_e4m3fn, "channel": scheme.values}.get(scheme.kind)
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, w in tensors:
        if scheme.kind in ("channel", "fp8") and name.rpartition(".")[2] in ACTIVATION_PARTS:
            continue
        split = _split(name, as_stored)
        if split is None or (values is not None and split[1] == "weight" and w.dtype != values):
            yield name, w
            continue
        module, part = split
        parts = pending.setdefault(module, {})
        parts[names[as_stored.index(part)]] = w
        if len(parts) == len(names):
            yield module, pending.pop(module)
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(stored.get(n, n) for n in set(names) - set(parts))
        raise UnsupportedModelError(f"{module} has {sorted(parts)} but no {missing} "
                                    f"({len(pending)} quantized weights incomplete)")


def hf_skips(module: str, patterns: list[str]) -> bool:
    """Whether transformers leaves `module` unquantized for `modules_to_not_convert` (its
    `should_convert_module`): a pattern matching from the start up to a module boundary, as a
    regex ("model.layers.*.self_attn"), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def not_float8(name: str, w: np.ndarray) -> np.ndarray:
    """`w`, unless it is float8: what the scheme dequantizes has none left, so such a tensor lacks the scales
    that would (UnsupportedModelError naming it)."""
    if w.dtype.name.startswith("float8"):
        raise UnsupportedModelError(f"{name!r} is float8 without the block scales this loader dequantizes "
                                    "(`weight_scale_inv` beside a `.weight`)")
    return w


def dequantized(tensors: Iterable[tuple[str, np.ndarray]], scheme: QuantScheme | None
                ) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with every quantized module's parts replaced by its float32 `weight`."""
    for name, w in tensors if scheme is None else grouped(tensors, scheme):
        if isinstance(w, dict):
            yield f"{name}.weight", dequantize_module(name, w, scheme)
        else:
            yield name, not_float8(name, w)
