"""Structured outputs: constraints (spec.py), their grammars (backend.py, llguidance), per-request
matchers that fill each step's token bitmask (matcher.py), and tool calling (tool_*.py)."""

from infire_jax.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
