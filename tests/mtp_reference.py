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


def normed_last_states(model, tokens: list[int]) -> np.ndarray:
    """An HF causal LM's last hidden states over `tokens`, after its final norm ([N, E] float64): what its head
    reads, and what vLLM hands an MTP layer as the target's states."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0].double().numpy()


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
                             position_embeddings=self.rotary_tables(u, positions))
            return self.output((out[0] if isinstance(out, tuple) else out)[0])

    def rotary_tables(self, u: torch.Tensor, positions: torch.Tensor):
        return self.rotary(u, positions)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """What the block's output passes on (to the head, and to the next draft)."""
        return h

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


class ReferenceQwenMTP(ReferenceMTP):
    """Qwen3.5's (or Qwen3.5-MoE's) MTP module as vLLM's qwen3_next_mtp.py runs it, in float64 with random weights from `seed`:
    fc over cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)), transformers' full-attention
    `Qwen3_5DecoderLayer` over the whole sequence recomputed from scratch, then its norm (Qwen's 1 + w
    RMSNorms); the logits are `head` over that normed output, which the next draft reads as its hidden."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, seed: int = 0):
        import importlib

        module, family = {"qwen3_5_text": ("qwen3_5", "Qwen3_5"), "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5Moe")}[
            config.model_type]
        m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        nn.Module.__init__(self)
        config._attn_implementation = config._experts_implementation = "eager"  # float64 runs
        e, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.norm = (getattr(m, f"{family}RMSNorm")(e, eps) for _ in range(3))
        self.eh_proj = nn.Linear(2 * e, e, bias=False)
        self.block = getattr(m, f"{family}DecoderLayer")(config, config.layer_types.index("full_attention"))
        self.rotary = getattr(m, f"{family}TextRotaryEmbedding")(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_((0.3 if "norm" in name else 0.1) * torch.randn(p.shape, generator=gen))
        self.embed, self.head = embed.double(), head.double()
        self.double().eval()

    def rotary_tables(self, u: torch.Tensor, positions: torch.Tensor):
        return self.rotary(u, positions[None].expand(3, 1, -1))  # multimodal RoPE's three position ids

    def output(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return (h @ self.head.T).numpy()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's `mtp.*` tensors, float32."""
        out = {"mtp.pre_fc_norm_embedding.weight": self.enorm.weight,
               "mtp.pre_fc_norm_hidden.weight": self.hnorm.weight,
               "mtp.fc.weight": self.eh_proj.weight, "mtp.norm.weight": self.norm.weight}
        out.update({f"mtp.layers.0.{name}": w for name, w in self.block.state_dict().items()})
        return {name: w.detach().to(torch.float32).contiguous() for name, w in out.items()}
