"""The router: one OpenAI-compatible endpoint in front of infire-jax worker servers (no engine, no JAX)."""
