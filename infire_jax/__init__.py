"""infire_jax: an LLM inference engine on JAX/XLA.

The public names load on first use, so that a process that needs none of them (`infire-jax router`,
which imports no jax) does not pay for the engine's imports."""

import importlib

from infire_jax.runner import xla_flags

xla_flags.apply()  # before anything can start a jax backend

_EXPORTS = {
    "Engine": "infire_jax.engine.engine", "EngineConfig": "infire_jax.engine.engine", "LLM": "infire_jax.llm",
    **dict.fromkeys(("CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "RequestOutput", "ScoringOutput",
                     "ScoringRequestOutput"), "infire_jax.outputs"),
    "PoolerConfig": "infire_jax.pooling.config", "PoolingParams": "infire_jax.pooling.config",
    **dict.fromkeys(("BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"), "infire_jax.sample.beam_search"),
    "Logprob": "infire_jax.sample.prompt_logprobs", "SamplingParams": "infire_jax.sample.sampling_params",
    "StructuredOutputs": "infire_jax.structured",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'infire_jax' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
