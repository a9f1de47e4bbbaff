"""LoRA adapters over one base model, many in one batch (vLLM's `--enable-lora`).

- `request.py`: `LoRARequest`, vLLM's name for an adapter a request runs with;
- `config.py`: the engine's LoRA settings (`--max-loras`, `--max-lora-rank`, `--max-cpu-loras`);
- `peft.py`: a PEFT adapter directory read and checked against the base model (host, numpy);
- `layout.py`: the device slots' layout: per adapted weight, stacked A [L, S, C*R, in...] and
  B [L, S, R, out...], and one adapter's arrays in it (fused, padded to the max rank, scaled);
- `slots.py`: which adapter holds which device slot, pinned by the running requests (host, no jax);
- `batched.py`: each token's LoRA delta, gathering its slot's A and B (BGMV / SGMV), jnp and the
  CPU kernel; where the decoder's projections take it (`LoRAWeight`, models/llama.py `linear`);
- `adapters.py`: an engine's adapters: registry, host LRU, paging into slots, the prefix-cache salt.
"""

from infire_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
