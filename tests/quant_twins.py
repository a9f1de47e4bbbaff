"""Float twins of a transformers model as `weights_quantization` int8 / fp8 / int4 keeps its layer weights:
each projection replaced, in place, by the values its kept form decodes to, computed here from the
formats' definitions (quant/resident.py `quantize_channels`, quant/int4_rtn.py's module doc), not by the
engine's code. An engine quantizing at load must then give the float engine's output on the twin.

Every projection is [..., out, in] in HF's layout (experts' [X, out, in] too); a kept scale spans an output
row's inputs (8-bit), or `group` consecutive ones of them (int4), except o_proj's 8-bit scale, which spans
one head's inputs: the model keeps wo as [Hq, D, E] with D its input axis.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import torch

PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
               "up_proj.weight", "down_proj.weight", "experts.gate_up_proj", "experts.down_proj",
               "in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight")  # the last three: Qwen3.5's DeltaNet
CHANNEL_MAX = {"int8": 127.0, "fp8": 448.0}
# A layer's projections in an HF checkpoint (GQA attention, MLPs, shared experts, Mixtral-named experts);
# not a MoE's router (`mlp.gate`)
LAYER_LINEAR = re.compile(r"(?:language_model\.)?model\.layers\.\d+\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj"
                          r"|down_proj|w1|w2|w3|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight")


def _channel(w: np.ndarray, kind: str) -> np.ndarray:
    """8-bit, symmetric, a float32 scale per row of the last axis: absmax / the kind's largest value (1 for
    an all-zero row), the values rounded to the kind (int8: to nearest; fp8: e4m3's nearest, ml_dtypes)."""
    top = np.float32(CHANNEL_MAX[kind])
    scale = np.abs(w).max(axis=-1, keepdims=True) / top
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    x = np.clip(w / scale, -top, top)
    q = np.rint(x) if kind == "int8" else x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q * scale


def _int4(w: np.ndarray, group: int) -> np.ndarray:
    """Asymmetric round to nearest in float64 over `group` consecutive inputs of a row (the last group
    shorter): lo = min(min, 0), hi = max(max, 0) (-1, 1 for a zero group), scale = float16((hi - lo) / 15)
    (at least 2^-24), zero = round(-lo / scale), q = clip(round(x / scale) + zero, 0, 15) -> (q - zero) * scale."""
    x = w.astype(np.float64).reshape(-1, w.shape[-1])
    out = np.empty_like(x)
    for start in range(0, x.shape[1], group):
        g = x[:, start:start + group]
        lo, hi = np.minimum(g.min(axis=1, keepdims=True), 0), np.maximum(g.max(axis=1, keepdims=True), 0)
        flat = (lo == 0) & (hi == 0)
        lo, hi = np.where(flat, -1.0, lo), np.where(flat, 1.0, hi)
        scale = np.maximum(((hi - lo) / 15).astype(np.float16), np.float16(2.0 ** -24)).astype(np.float64)
        zero = np.clip(np.rint(-lo / scale), 0, 15)
        q = np.clip(np.rint(g / scale) + zero, 0, 15)
        out[:, start:start + group] = (q - zero) * scale
    return out.reshape(w.shape).astype(np.float32)


def quantize_twin(model: torch.nn.Module, mode: str, head_dim, group: int = 128) -> None:
    """Replaces `model`'s projections by their `mode` ("int8", "fp8", "int4" in groups of `group`) twins;
    `head_dim(name)`: the head width of the layer holding o_proj `name`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(PROJECTIONS):
                continue
            w = p.detach().numpy().astype(np.float32)
            if mode == "int4":
                twin = _int4(w, group)
            elif name.endswith("o_proj.weight"):  # one scale per output and head
                d = head_dim(name)
                twin = _channel(w.reshape(w.shape[0], -1, d), mode).reshape(w.shape)
            else:
                twin = _channel(w, mode)
            p.copy_(torch.from_numpy(twin))


def twin_outputs(path: str, engine: dict, prompts: list, params) -> list:
    """The float engine's outputs (each request's first completion) on the twin checkpoint at `path`."""
    from infire_jax import LLM

    llm = LLM(model=path, **engine)
    try:
        want = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
    assert len(set(want[0].token_ids)) > 3  # not a degenerate repetition
    return want


def assert_kept_and_follows_twin(path: str, engine: dict, kept: list[str], part: str, prompts: list, params,
                                 want: list, atol: float) -> int:
    """The engine on the float checkpoint at `path` (`engine` names its weights_quantization) holds each
    weight of `kept` ("moe_layers.wqkv") as its quantized parts alone (`part`: "int8", "fp8", "q4"), and
    gives the twin's greedy tokens (`want`), their logprobs within `atol`. Returns its weights' bytes."""
    from flax import nnx

    from infire_jax import LLM

    llm = LLM(model=path, **engine)
    try:
        placed = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(llm.engine.runner.state)}
        missing = [w for w in kept if f"{w}.{part}" not in placed or w in placed]
        assert not missing, (missing, sorted(placed))
        outs = llm.generate(prompts, params)
        weight_bytes = llm.engine.runner.weight_bytes
    finally:
        llm.engine.close()
    for got, f in zip(outs, want):
        assert got.outputs[0].token_ids == f.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.outputs[0].logprobs, f.token_ids)],
                                   [lp[t].logprob for lp, t in zip(f.logprobs, f.token_ids)], atol=atol, rtol=0)
    return weight_bytes


def placed_and_greedy(engine: dict, prompt, num_tokens: int) -> tuple[set[str], object]:
    """An engine's placed weights' names and its greedy completion of `prompt` (logprobs of each token)."""
    from flax import nnx

    from infire_jax import LLM, SamplingParams

    llm = LLM(**engine)
    try:
        placed = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(llm.engine.runner.state)}
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=1)
        return placed, llm.generate(prompt, params)[0].outputs[0]
    finally:
        llm.engine.close()


def assert_greedy(out, tokens: list[int], logprobs: list[float], atol: float) -> None:
    """A completion's tokens are `tokens`, their logprobs `logprobs` within `atol`."""
    assert out.token_ids == tokens
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, tokens)], logprobs, atol=atol, rtol=0)


def write_8bit(src: str, dst: str, twin: str, scheme: str, block: int = 0, ignore: str | None = None,
               linear: re.Pattern = LAYER_LINEAR) -> None:
    """The float HF checkpoint at `src` written twice: at `dst` with every projection `linear` matches (by
    default the layers', LAYER_LINEAR) in `scheme`, and at `twin` as the float checkpoint of the values
    those decode to (float64 products, in float32). "fp8-block": e4m3 values and a float32 `weight_scale_inv` per `block` x `block` block (absmax
    / 448; the last ones partial where `block` does not tile a side), with MiniMax-M2's published
    quantization_config; "fp8-channel": llm-compressor's FP8-dynamic
    (compressed-tensors, a bfloat16 `weight_scale` per row, the activations' token-wise scales dynamic),
    the modules `ignore` matches (a regex, as its config's "re:" entries) left float."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, floats = {}, {}
    for name, w in tensors.items():
        if not linear.fullmatch(name) or (ignore and re.match(ignore, name.removesuffix(".weight"))):
            quantized[name] = floats[name] = w
            continue
        o, i = w.shape
        if scheme == "fp8-block":  # the last row and column blocks may be partial
            rows, cols = -(-o // block), -(-i // block)
            padded = np.zeros((rows * block, cols * block), np.float32)
            padded[:o, :i] = np.abs(w)
            stored = (padded.reshape(rows, block, cols, block).max(axis=(1, 3)) / 448.0).astype(np.float32)
            each = np.repeat(np.repeat(stored.astype(np.float64), block, axis=0), block, axis=1)[:o, :i]
            quantized[f"{name}_scale_inv"] = stored
        else:
            stored = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(ml_dtypes.bfloat16)
            each = np.broadcast_to(stored.astype(np.float64), w.shape)
            quantized[f"{name}_scale"] = stored
        q = (w / each).astype(ml_dtypes.float8_e4m3fn)
        quantized[name] = q
        floats[name] = (q.astype(np.float64) * each).astype(np.float32)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if scheme == "fp8-block":
        config["quantization_config"] = dict(quant_method="fp8", fmt="float8_e4m3fn", activation_scheme="dynamic",
                                             weight_block_size=[block, block],
                                             modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])
    else:
        from channel_models import DYNAMIC, _compressed

        config["quantization_config"] = _compressed("float", "channel", DYNAMIC)
        config["quantization_config"]["ignore"] += [f"re:{ignore}"] if ignore else []
    for path, weights, cfg in ((dst, quantized, config), (twin, floats, None)):
        shutil.copytree(src, path)
        save_file(weights, os.path.join(path, "model.safetensors"))
        if cfg is not None:
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(cfg, f)


def unfuse_experts(src: str, dst: str) -> None:
    """The checkpoint at `src` with each layer's fused experts written as one linear module per expert in
    HF's `[out, in]` layout (`experts.N.gate_proj.weight` [F, E], `up_proj` [F, E], `down_proj` [E, F]), as
    8-bit releases hold them (Llama 4 Maverick's FP8, Qwen3.5-MoE's). Fused, Llama 4 keeps `gate_up_proj`
    [X, E, 2F] and `down_proj` [X, F, E] ([in, out]), transformers' Qwen3.5-MoE [X, 2F, E] and [X, E, F]."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        llama4 = json.load(f)["model_type"].startswith("llama4")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        prefix, _, part = name.rpartition(".")
        if not prefix.endswith(".experts") or part not in ("gate_up_proj", "down_proj"):
            out[name] = w
            continue
        for j, e in enumerate(w):
            e = e.T if llama4 else e  # [out, in]
            if part == "gate_up_proj":
                f = e.shape[0] // 2
                out[f"{prefix}.{j}.gate_proj.weight"] = np.ascontiguousarray(e[:f])
                out[f"{prefix}.{j}.up_proj.weight"] = np.ascontiguousarray(e[f:])
            else:
                out[f"{prefix}.{j}.down_proj.weight"] = np.ascontiguousarray(e)
    shutil.copytree(src, dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
