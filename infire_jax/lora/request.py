"""`LoRARequest`: the adapter a request runs with, as vLLM names it (no jax)."""

from __future__ import annotations

import dataclasses

from infire_jax.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: a PEFT adapter directory, known to
    the engine by its name and its integer id (each unique while the adapter is loaded)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("LoRARequest.lora_name must be a non-empty string", param="lora_name")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}",
                                      param="lora_int_id")
        if not isinstance(self.lora_path, str):
            raise InvalidRequestError(f"LoRARequest.lora_path must be a string, got {self.lora_path!r}",
                                      param="lora_path")
