"""The engine's LoRA settings, vLLM's names and meanings (no jax)."""

from __future__ import annotations

import dataclasses

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapters fit in the device slots at once (slot 0 is the base model: no adapter),
    each padded to `max_lora_rank`; `max_cpu_loras` loaded adapters are kept in host memory, least
    recently used first out (default: max_loras). Part of the runner's settings, so of every step
    program's cache key."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def check(self, cfg: ModelConfig, *, multiprocess: bool) -> None:
        """Refuses settings and models the adapters cannot serve, naming the problem."""
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                              f"{self.max_lora_rank}")
        if self.cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.cpu_loras}) must be >= max_loras ({self.max_loras})")
        if cfg.mla is not None:
            raise ConfigError(f"LoRA adapters are supported on the Llama family (dense and MoE), not on "
                              f"{cfg.architecture} (latent attention)")
        own_layers = (("Llama 4", cfg.llama4, "llama4"), ("gpt-oss", cfg.gpt_oss, "gpt_oss"),
                      (cfg.architecture, cfg.glm4, "glm4_moe"), ("Gemma 3", cfg.gemma3, "gemma3"),
                      ("Gemma 4", cfg.gemma4, "gemma4"), ("Qwen3.5", cfg.gated_delta, "qwen3_5"))
        for name, family, module in own_layers:
            if family is not None:
                raise ConfigError(f"LoRA adapters are supported on the Llama family (dense and MoE), not on {name} "
                                  f"(its layers are models/{module}.py's, which take no adapter yet)")
        if multiprocess:
            raise ConfigError("LoRA adapters are not supported across several processes yet")
