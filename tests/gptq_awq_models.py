"""Tiny random Llama (or Qwen2: q/k/v biases) checkpoints in the exact GPTQ and AWQ (GEMM) layouts,
and the float64 reference.

Everything here is written from the formats' definitions (quant/gptq_awq.py's docstring lists
them), word by word and nibble by nibble, independent of infire_jax's vectorized unpacking:

- GPTQ `qweight[j, o]` holds input `8j + k` of output o in bits 4k; `qzeros[g, j]` holds output
  `8j + k`'s zero of group g in bits 4k, minus one in checkpoint_format v1; `g_idx[i]` is input i's
  group.
- AWQ `qweight[i, j]` holds output `8j + ORDER[k]` in bits 4k, ORDER = [0, 2, 4, 6, 1, 3, 5, 7],
  `qzeros[g, j]` likewise; groups are runs of consecutive inputs.
- `w[o, i] = (q - z) * s` with z and s those of input i's group.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from deepseek_models import VOCAB, _save_tokenizer

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=128,
              intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, torch_dtype="float16")
FAMILIES = {"llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
            "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                          sliding_window=4096)}
LINEARS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
           "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
           "mlp.down_proj": (128, 256)}  # (out, in)


def quantize(w: np.ndarray, group: int, sym: bool, act_order: bool, rng) -> dict:
    """Round-to-nearest 4-bit values `q [I, O]`, zeros and fp16 scales `[G, O]`, and `g_idx [I]` for
    `w [O, I]` (act-order: groups over a random permutation of the inputs)."""
    out, inp = w.shape
    size = inp if group == -1 else group
    order = rng.permutation(inp) if act_order else np.arange(inp)
    g_idx = np.empty(inp, np.int32)
    g_idx[order] = np.arange(inp) // size
    groups = inp // size
    scales, zeros = np.zeros((groups, out), np.float16), np.zeros((groups, out), np.int64)
    q = np.zeros((inp, out), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(axis=1), cols.max(axis=1)
        if sym:
            s, z = (np.maximum(-lo, hi) * 2 / 15).astype(np.float16), np.full(out, 8)
        else:  # zeros 1..15 keep v1's stored zero - 1 in range; a zero of 16 is tested apart
            s = ((hi - lo) / 15).astype(np.float16)
            z = np.clip(np.rint(-lo / s.astype(np.float64)), 1, 15).astype(np.int64)
        scales[g], zeros[g] = s, z
        q[g_idx == g] = np.clip(np.rint(cols / s.astype(np.float64)[:, None]) + z[:, None], 0, 15).T
    return dict(q=q, zeros=zeros, scales=scales, g_idx=g_idx)


def _word(nibbles) -> np.int32:
    v = 0
    for k, n in enumerate(nibbles):
        v |= (int(n) & 0xF) << (4 * k)
    return np.array(v, np.uint32).view(np.int32)


def pack_gptq(qt: dict, v1: bool) -> dict[str, np.ndarray]:
    q, zeros = qt["q"], qt["zeros"] - (1 if v1 else 0)
    inp, out = q.shape
    qweight = np.array([[_word(q[8 * j:8 * j + 8, o]) for o in range(out)] for j in range(inp // 8)], np.int32)
    qzeros = np.array([[_word(zeros[g, 8 * j:8 * j + 8]) for j in range(out // 8)] for g in range(len(zeros))],
                      np.int32)
    return dict(qweight=qweight, qzeros=qzeros, scales=qt["scales"], g_idx=qt["g_idx"])


def pack_awq(qt: dict) -> dict[str, np.ndarray]:
    def pack(a):  # [rows, O] -> [rows, O / 8], nibble k of word j holding column 8j + ORDER[k]
        return np.array([[_word([a[r, 8 * j + ORDER[k]] for k in range(8)]) for j in range(a.shape[1] // 8)]
                         for r in range(a.shape[0])], np.int32)

    return dict(qweight=pack(qt["q"]), qzeros=pack(qt["zeros"]), scales=qt["scales"])


def _field(words: np.ndarray, k) -> np.ndarray:
    """Bits 4k..4k+3 of int32 words (k per word)."""
    return (words.view(np.uint32).astype(np.int64) >> (4 * np.asarray(k))) & 0xF


def reference_gptq(t: dict[str, np.ndarray], v1: bool) -> np.ndarray:
    """float64 `w [O, I]` of a GPTQ module, input by input."""
    inp, out = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
    o = np.arange(out)
    w = np.zeros((out, inp))
    for i in range(inp):
        g = t["g_idx"][i]
        q = _field(t["qweight"][i // 8], i % 8)
        z = _field(t["qzeros"][g, o // 8], o % 8) + (1 if v1 else 0)
        w[:, i] = (q - z) * t["scales"][g].astype(np.float64)
    return w


def reference_awq(t: dict[str, np.ndarray], group: int) -> np.ndarray:
    """float64 `w [O, I]` of an AWQ GEMM module, input by input."""
    inp, out = t["qweight"].shape[0], t["qweight"].shape[1] * 8
    size = inp if group == -1 else group
    o = np.arange(out)
    k = np.array([ORDER.index(m) for m in range(8)])[o % 8]  # the nibble holding output o
    w = np.zeros((out, inp))
    for i in range(inp):
        q, z = _field(t["qweight"][i, o // 8], k), _field(t["qzeros"][i // size, o // 8], k)
        w[:, i] = (q - z) * t["scales"][i // size].astype(np.float64)
    return w


def quantization_config(method: str, group: int, *, sym: bool = False, act_order: bool = False,
                        v1: bool = True) -> dict:
    if method == "awq":
        return dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm",
                    modules_to_not_convert=None)
    return dict(quant_method="gptq", bits=4, group_size=group, desc_act=act_order, sym=sym, damp_percent=0.01,
                true_sequential=True, checkpoint_format="gptq" if v1 else "gptq_v2")


def write_checkpoint(path: pathlib.Path, method: str, group: int, *, sym: bool = False, act_order: bool = False,
                     v1: bool = True, family: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """A quantized checkpoint at `path` (config.json, model.safetensors, tokenizer.json) and, for a float
    twin, the float32 weights its quantized tensors define (reference dequantization), by HF name.
    Qwen2's q/k/v biases stay float16, as its GPTQ / AWQ checkpoints store them."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    e = CONFIG["hidden_size"]
    tensors = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, e)).astype(np.float16),
               "lm_head.weight": (rng.standard_normal((VOCAB, e)) * 0.1).astype(np.float16),
               "model.norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float16)}
    defined = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{pre}.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(e)).astype(np.float16)
        for name, shape in LINEARS.items():
            qt = quantize(rng.standard_normal(shape) / np.sqrt(shape[1]), group, sym, act_order, rng)
            parts = pack_awq(qt) if method == "awq" else pack_gptq(qt, v1)
            tensors.update({f"{pre}.{name}.{p}": a for p, a in parts.items()})
            ref = reference_awq(parts, group) if method == "awq" else reference_gptq(parts, v1)
            defined[f"{pre}.{name}.weight"] = ref.astype(np.float32)
            if family == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                tensors[f"{pre}.{name}.bias"] = (0.1 * rng.standard_normal(shape[0])).astype(np.float16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(CONFIG, **FAMILIES[family],
                  quantization_config=quantization_config(method, group, sym=sym, act_order=act_order, v1=v1))
    (path / "config.json").write_text(json.dumps(config))
    _save_tokenizer(path)
    return defined


def write_float_twin(path: pathlib.Path, quantized: pathlib.Path, defined: dict[str, np.ndarray]) -> None:
    """The float checkpoint holding the quantized one's other tensors and the `defined` weights."""
    from safetensors.numpy import load_file, save_file

    src = load_file(str(quantized / "model.safetensors"))
    keep = {k: v for k, v in src.items() if k.rpartition(".")[2] not in ("qweight", "qzeros", "scales", "g_idx")}
    path.mkdir(parents=True, exist_ok=True)
    save_file({**keep, **defined}, str(path / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    _save_tokenizer(path)
