"""A float64 torch MTP module (DeepSeek-V3 paper, section 2.2; vLLM's deepseek_mtp.py), independent of infire_jax.

transformers does not implement MTP, so this composes its `DeepseekV3DecoderLayer` (GLM-4.5's:
`Glm4MoeDecoderLayer`) with the MTP's own
modules: enorm, hnorm, eh_proj over cat(embedding, hidden), the decoder layer over the whole sequence
recomputed from scratch (eager attention, a causal mask, no cache, no pages), shared_head's norm and head.
`tensors()` writes it as the checkpoint's layer `num_hidden_layers`, experts one by one as published.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class ReferenceMTP(nn.Module):
    """The MTP layer of `config` (a DeepseekV3Config or Glm4MoeConfig) with random weights drawn from `seed`;
    `embed` [V, E] is the embedding it reads and `head` [V, E] its shared_head.head (the target's, as the
    checkpoints ship them)."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, seed: int = 0):
        import importlib

        family = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}[config.model_type]
        modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        DecoderLayer, RMSNorm, RotaryEmbedding = (getattr(modeling, f"{family}{name}")
                                                  for name in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))
        super().__init__()
        config._attn_implementation = config._experts_implementation = "eager"  # float64 runs
        e, self.index = config.hidden_size, config.num_hidden_layers
        self.enorm, self.hnorm = RMSNorm(e, config.rms_norm_eps), RMSNorm(e, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * e, e, bias=False)
        self.block = DecoderLayer(config, self.index)
        self.norm = RMSNorm(e, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in [*self.named_parameters(), *self.block.named_buffers(prefix="block")]:
                if "norm" in name:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith("bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        self.embed, self.head = embed.double(), head.double()
        self.double().eval()

    def layer(self, tokens: np.ndarray, hidden: np.ndarray) -> torch.Tensor:
        """The MTP block's output [N, E] over a sequence: inputs (embed(tokens[p]), hidden[p]) at positions 0..N-1."""
        n = len(tokens)
        x = torch.cat([self.enorm(self.embed[torch.as_tensor(tokens)]),
                       self.hnorm(torch.as_tensor(hidden, dtype=torch.float64))], dim=-1)
        u = self.eh_proj(x)[None]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        with torch.no_grad():
            out = self.block(u, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(u, positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(self, h: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return (self.norm(h) @ self.head.T).numpy()

    def greedy_chain(self, tokens: np.ndarray, hidden: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
        """k greedy drafts after the sequence, vLLM's recursion: each draft and the block's output at the
        last position are the next position's inputs. Returns the drafts and their logits [k, V]."""
        tokens, hidden = np.asarray(tokens), np.asarray(hidden, np.float64)
        drafts, logits = [], []
        for _ in range(k):
            with torch.no_grad():
                out = self.layer(tokens, hidden)[-1]
            logits.append(self.logits(out))
            drafts.append(int(np.argmax(logits[-1])))
            tokens, hidden = np.append(tokens, drafts[-1]), np.concatenate([hidden, out.numpy()[None]])
        return drafts, np.stack(logits)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors of this layer, float32, HF names: the MoE's experts one by one."""
        prefix = f"model.layers.{self.index}."
        out = {f"{prefix}{name}": w for name, w in (("enorm.weight", self.enorm.weight), ("hnorm.weight", self.hnorm.weight),
                                                    ("eh_proj.weight", self.eh_proj.weight),
                                                    ("shared_head.norm.weight", self.norm.weight),
                                                    ("shared_head.head.weight", self.head),
                                                    ("embed_tokens.weight", self.embed))}
        for name, w in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                f = w.shape[1] // 2
                for j in range(w.shape[0]):
                    out[f"{prefix}mlp.experts.{j}.gate_proj.weight"] = w[j, :f]
                    out[f"{prefix}mlp.experts.{j}.up_proj.weight"] = w[j, f:]
            elif name == "mlp.experts.down_proj":
                for j in range(w.shape[0]):
                    out[f"{prefix}mlp.experts.{j}.down_proj.weight"] = w[j]
            else:
                out[f"{prefix}{name}"] = w
        return {name: w.detach().to(torch.float32).contiguous() for name, w in out.items()}
