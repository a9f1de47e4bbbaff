"""Embeddings from a causal LM (vLLM's pooling runner): settings (config.py) and the host side of a step (plan.py)."""
