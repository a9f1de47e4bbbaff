"""Weight-only quantization kept quantized in device memory.

`formats`: the published int4 group (compressed-tensors pack-quantized), fp8 128x128 block
(DeepSeek-V3) and int8 per-channel formats, their exact dequantizers and `linear`;
`gguf_blocks`: GGUF Q4_1 / Q8_0 blocks as device arrays; `resident`: quantized stacked layer
weights in the model, dequantized one layer at a time inside the layer scan.
"""
