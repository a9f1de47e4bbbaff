"""infire_jax: an LLM inference engine on JAX/XLA."""

from infire_jax.runner import xla_flags

xla_flags.apply()  # before anything can start a jax backend

# ruff: noqa: E402
from infire_jax.engine.engine import Engine, EngineConfig
from infire_jax.llm import LLM
from infire_jax.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                                ScoringRequestOutput)
from infire_jax.pooling.config import PoolerConfig, PoolingParams
from infire_jax.sample.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from infire_jax.sample.prompt_logprobs import Logprob
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.structured import StructuredOutputs

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "Engine", "EngineConfig", "Logprob", "PoolerConfig", "PoolingParams",
           "RequestOutput", "SamplingParams", "ScoringOutput", "ScoringRequestOutput", "StructuredOutputs"]
__version__ = "0.1.0"
