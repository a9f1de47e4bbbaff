"""A float64 numpy EAGLE-3 head, written from the paper and the public EAGLE code (eagle/model/cnets.py).

Independent of infire_jax: HF weight names and layout (y = x @ W.T), one sequence at a time, dense
causal attention over the whole sequence recomputed from scratch (no cache, no pages), GQA by
repeating kv heads, rotate-half RoPE with plain theta (or the config's scaling, as transformers computes it).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_frequencies(cfg: Mapping, d: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies, cos/sin factor): plain theta's, or a config's `rope_scaling` (YaRN as NVIDIA's
    gpt-oss heads carry it) as transformers' own ROPE_INIT_FUNCTIONS compute them."""
    theta = cfg.get("rope_theta", 10000.0)
    if not cfg.get("rope_scaling"):
        return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"], head_dim=d,
                     max_position_embeddings=cfg["max_position_embeddings"], rope_theta=theta,
                     rope_scaling=dict(cfg["rope_scaling"]))
    inv, factor = ROPE_INIT_FUNCTIONS[cfg["rope_scaling"]["rope_type"]](hf, "cpu")
    return inv.double().numpy(), float(factor)


def rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """x [N, H, D]: HF's rotate_half form, cos/sin of cat(freqs, freqs) times `factor`."""
    d = x.shape[-1]
    angles = positions.astype(np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) * factor + rotated * np.sin(emb) * factor


class ReferenceEagle3:
    """`w`: the checkpoint's tensors by HF name (`midlayer.` prefix), `cfg`: its config.json, `embed`: [V, E]."""

    def __init__(self, w: Mapping[str, np.ndarray], cfg: Mapping, embed: np.ndarray):
        self.w = {k: np.asarray(v, np.float64) if v.dtype.kind == "f" else np.asarray(v) for k, v in w.items()}
        self.cfg = cfg
        self.embed = np.asarray(embed, np.float64)
        self.eps = cfg["rms_norm_eps"]
        self.hq, self.hkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def layer(self, tokens: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """The midlayer over a whole sequence: inputs (embed(tokens[p]), hidden[p], width E) at positions 0..N-1."""
        w, eps, n = self.w, self.eps, len(tokens)
        residual = hidden
        x = np.concatenate([rms_norm(self.embed[tokens], w["midlayer.input_layernorm.weight"], eps),
                            rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)], axis=-1)
        pos = np.arange(n)
        freqs = rope_frequencies(self.cfg, self.d)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).reshape(n, self.hq, self.d)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).reshape(n, self.hkv, self.d)
        if self.cfg.get("model_type") == "qwen3":  # Qwen3's layer: each head's q and k RMS-normed before RoPE
            q, k = (rms_norm(a, w[f"midlayer.self_attn.{name}.weight"], eps) for a, name in ((q, "q_norm"), (k, "k_norm")))
        q, k = rope(q, pos, *freqs), rope(k, pos, *freqs)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).reshape(n, self.hkv, self.d)
        rep = self.hq // self.hkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.d)
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(n, self.hq * self.d)
        h = residual + o @ w["midlayer.self_attn.o_proj.weight"].T
        y = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = y @ w["midlayer.mlp.gate_proj.weight"].T, y @ w["midlayer.mlp.up_proj.weight"].T
        return h + (gate / (1 + np.exp(-gate)) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def logits(self, h: np.ndarray) -> np.ndarray:
        """With speculators' `norm_output`, `h` is already normed (`output`)."""
        normed = h if self.cfg.get("norm_output") else rms_norm(h, self.w["norm.weight"], self.eps)
        return normed @ self.w["lm_head.weight"].T

    def output(self, h: np.ndarray) -> np.ndarray:
        """The state a draft passes to the next: normed where the config says `norm_output` (Eagle 3.1)."""
        return rms_norm(h, self.w["norm.weight"], self.eps) if self.cfg.get("norm_output") else h

    def fuse(self, hidden: np.ndarray) -> np.ndarray:
        """fc over the three states, after speculators' `norm_before_fc` (one norm over all three) or `fc_norm`
        (one over each)."""
        if self.cfg.get("norm_before_fc"):
            hidden = rms_norm(hidden, self.w["input_norm.weight"], self.eps)
        elif self.cfg.get("fc_norm"):
            hidden = np.concatenate([rms_norm(part, self.w[f"fc_norm.{i}.weight"], self.eps)
                                     for i, part in enumerate(np.split(hidden, 3, axis=-1))], axis=-1)
        return hidden @ self.w["fc.weight"].T

    def greedy_chain(self, tokens: np.ndarray, hidden: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
        """The sequence's catch-up inputs (positions 0..N-1), then k greedy drafts in target ids, as
        EAGLE's drafting loop does: each draft's embedding and the head's last output feed the next."""
        if hidden.shape[-1] != self.embed.shape[-1]:
            hidden = self.fuse(hidden)
        tokens, hidden = np.asarray(tokens), np.asarray(hidden)
        drafts, logits = [], []
        for _ in range(k):
            out = self.output(self.layer(tokens, hidden)[-1])
            logits.append(self.logits(out))
            best = int(np.argmax(logits[-1]))
            drafts.append(best + int(self.w["d2t"][best]))
            tokens, hidden = np.append(tokens, drafts[-1]), np.concatenate([hidden, out[None]])
        return drafts, np.stack(logits)
