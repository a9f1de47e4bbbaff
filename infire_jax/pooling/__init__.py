"""Embeddings from a causal LM (vLLM's pooling runner): settings (config.py), the host side of a step
(plan.py), and pairs' scores from embeddings (scoring.py)."""
