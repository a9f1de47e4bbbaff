"""`weights_quantization="checkpoint"` for gpt-oss: the checkpoint's MXFP4 experts kept as they are
published (quant/mxfp4.py: 4.25 bits a weight, each expert dequantized alone where it is used), every
other weight in the serving dtype. gpt-oss-120b's experts take 61 GB so, 233 GB in bfloat16.

On a mesh the parts split as the float experts do (ep or tp: whole experts, blocks and scales together;
tp over `mlp`: w_down's inputs in whole blocks of 32), and a mesh that would split a block is refused
naming the weight (deepseek_quant.check_mesh, the same check as for its kept formats)."""

from __future__ import annotations

import os

import jax.numpy as jnp

from infire_jax.errors import ConfigError
from infire_jax.loaders.deepseek_quant import check_mesh
from infire_jax.loaders.dummy import dummy_hf_config, load_dummy
from infire_jax.loaders.gpt_oss_hf import gpt_oss_weights
from infire_jax.loaders.hf import checkpoint_tensors, read_hf_config
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.gpt_oss import KEPT_EXPERTS
from infire_jax.models.registry import build_state
from infire_jax.quant.grouped import GroupedLayout
from infire_jax.quant.mxfp4 import BLOCK
from sharding.plan import ShardPlan

def is_gpt_oss(spec: str | None) -> bool:
    """Whether `spec` is an HF directory of a gpt-oss model or a `dummy:` one."""
    if spec and spec.startswith("dummy:"):
        return dummy_hf_config(spec[len("dummy:"):]).get("model_type") == "gpt_oss"
    return os.path.isfile(os.path.join(spec or "", "config.json")) and read_hf_config(spec).gpt_oss is not None


def kept_layouts() -> dict[str, GroupedLayout]:
    """The layouts of gpt-oss's kept experts (a dummy's are drawn so; bench/gpu_target.py builds them)."""
    return {t: GroupedLayout("mxfp4", BLOCK, jnp.uint8) for t in KEPT_EXPERTS}


def load_kept_placed(path: str, dtype, plan: ShardPlan | None) -> Placed:
    """The model placed with its checkpoint's MXFP4 experts kept (a dummy's drawn as MXFP4 parts);
    ConfigError if it has none."""
    if path.startswith("dummy:"):
        loaded = load_dummy(path[len("dummy:"):])
        layouts = kept_layouts()
        if plan is not None:
            check_mesh(layouts, loaded.config, plan)
        graphdef, state = build_state(loaded.config, None, dtype, plan=plan, seed=loaded.random_seed,
                                      quantized=layouts)
        return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
    cfg = read_hf_config(path)
    if plan is not None:  # before a weight is read
        check_mesh(kept_layouts(), cfg, plan)
    weights = gpt_oss_weights(checkpoint_tensors(path), cfg, keep_mxfp4=True)
    layouts = {t: GroupedLayout("mxfp4", BLOCK, jnp.uint8) for t in KEPT_EXPERTS if f"{t}.fp4" in weights}
    if not layouts:
        raise ConfigError(f"weights_quantization='checkpoint': {path} stores its experts unquantized; leave "
                          "weights_quantization unset")
    graphdef, state = build_state(cfg, weights, dtype, plan=plan, quantized=layouts)
    loaded = LoadedModel(config=cfg, tokenizer=Tokenizer.from_dir(path), name=os.path.basename(os.path.normpath(path)),
                         weights=weights)
    return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
