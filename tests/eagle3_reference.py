"""A float64 numpy EAGLE-3 head, written from the paper and the public EAGLE code (eagle/model/cnets.py).

Independent of infire_jax: HF weight names and layout (y = x @ W.T), one sequence at a time, dense
causal attention over the whole sequence recomputed from scratch (no cache, no pages), GQA by
repeating kv heads, rotate-half RoPE with plain theta.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [N, H, D]: HF's rotate_half form, cos/sin of cat(freqs, freqs)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions.astype(np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


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
        theta = self.cfg.get("rope_theta", 10000.0)
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).reshape(n, self.hq, self.d), pos, theta)
        k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).reshape(n, self.hkv, self.d), pos, theta)
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
        return rms_norm(h, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T

    def greedy_chain(self, tokens: np.ndarray, hidden: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
        """The sequence's catch-up inputs (positions 0..N-1), then k greedy drafts in target ids, as
        EAGLE's drafting loop does: each draft's embedding and the head's last output feed the next."""
        if hidden.shape[-1] != self.embed.shape[-1]:
            hidden = hidden @ self.w["fc.weight"].T
        tokens, hidden = np.asarray(tokens), np.asarray(hidden)
        drafts, logits = [], []
        for _ in range(k):
            out = self.layer(tokens, hidden)[-1]
            logits.append(self.logits(out))
            best = int(np.argmax(logits[-1]))
            drafts.append(best + int(self.w["d2t"][best]))
            tokens, hidden = np.append(tokens, drafts[-1]), np.concatenate([hidden, out[None]])
        return drafts, np.stack(logits)
