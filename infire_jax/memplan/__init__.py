"""`infire-jax plan`: whether a model fits a set of devices, and how much KV cache room it leaves.

`model.py` turns a model (one of ours, or an HF config.json, MLA included) into its tensors;
`plan.py` splits them over a mesh and subtracts weights, activations and workspace from each
device; `source.py` resolves the model argument; `configs/` holds the published configs of the
flagship models (Kimi K2.5, DeepSeek-V3).
"""
