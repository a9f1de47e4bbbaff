"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against HF transformers, and the MoE block itself.

End to end: tiny random HF checkpoints are saved to disk, loaded through our HF loader, and decoded
greedily; tokens and logprobs must match HF's own `generate`. The routing and the grouped expert MLP are
checked against float64 numpy, and the grouped matmul must not build a dense per-expert intermediate.
"""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infire_jax.models.config import ModelConfig
from infire_jax.models.moe import dispatch, moe_mlp, route_for

VOCAB = 300
NUM_TOKENS = 32


def _cfg(arch: str, *, experts: int, k: int, norm_topk_prob: bool = True, width: int = 24) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=VOCAB, hidden_size=32, intermediate_size=0, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=16, num_experts=experts, num_experts_per_tok=k,
                       moe_intermediate_size=width, norm_topk_prob=norm_topk_prob)


# ---- routing -------------------------------------------------------------------------------------

def _np_route(logits: np.ndarray, k: int, renormalize: bool):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, axis=-1)
    if renormalize:
        w /= w.sum(-1, keepdims=True)
    return w, idx


@pytest.mark.parametrize("arch,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
@pytest.mark.parametrize("experts,k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routing_matches_float64(arch, norm, experts, k, dtype):
    cfg = _cfg(arch, experts=experts, k=k, norm_topk_prob=norm)
    logits = jnp.asarray(np.random.default_rng(experts + k).normal(0, 2, (64, experts)), dtype)
    r = route_for(cfg, logits)
    want_w, want_idx = _np_route(np.asarray(logits.astype(jnp.float32)), k, renormalize=norm)
    np.testing.assert_array_equal(np.asarray(r.experts), want_idx)
    # HF keeps Mixtral's weights in float32 and casts Qwen3-MoE's back to the logits' dtype.
    assert r.weights.dtype == (dtype if arch == "qwen3_moe" else jnp.float32)
    tol = 1e-6 if r.weights.dtype == jnp.float32 else 4e-3
    np.testing.assert_allclose(np.asarray(r.weights.astype(jnp.float32)), want_w, rtol=tol, atol=tol)


# ---- the MoE block -------------------------------------------------------------------------------

def _layer_weights(rng, cfg: ModelConfig, router_bias: np.ndarray | None = None):
    e, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    lp = {"router": rng.normal(0, 0.5, (e, x)), "w_gate_up": rng.normal(0, 0.2, (x, e, 2, f)),
          "w_down": rng.normal(0, 0.2, (x, f, e))}
    inputs = rng.normal(0, 1, (cfg.hidden_size,))
    if router_bias is not None:  # a direction of x that favours some experts: skewed group sizes
        lp["router"] += np.outer(inputs, router_bias) / (inputs @ inputs)
    return {k: v.astype(np.float32) for k, v in lp.items()}, inputs


def _np_moe(lp, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Token by token, each through its k experts, in float64."""
    lp = {k: v.astype(np.float64) for k, v in lp.items()}
    x = x.astype(np.float64)
    w, idx = _np_route(x @ lp["router"], cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, ex in enumerate(idx[t]):
            g, u = x[t] @ lp["w_gate_up"][ex][:, 0], x[t] @ lp["w_gate_up"][ex][:, 1]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ lp["w_down"][ex])
    return out


def _in_kernel(lp: dict) -> dict:
    """The layer's experts handed to the grouped kernel (Pallas interpret mode here) as a stack of one layer."""
    from infire_jax.models.quant_kernels import EXPERT_INPUTS, LayerExperts, kernel_stacks

    stacks = kernel_stacks({k: jnp.asarray(lp[k])[None] for k in EXPERT_INPUTS}, 1, {}, EXPERT_INPUTS)
    assert set(stacks) == set(EXPERT_INPUTS)
    return {**lp, **{k: LayerExperts(kw, jnp.int32(0)) for k, kw in stacks.items()}}


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "pallas"])
@pytest.mark.parametrize("tokens,experts,k,skew", [(37, 8, 2, False), (100, 16, 4, False), (100, 16, 4, True),
                                                   (3, 16, 4, False)])
def test_moe_mlp_matches_float64(impl, tokens, experts, k, skew):
    # the grouped kernel tiles the inputs of w_down in blocks of at least 16: an expert width of 32
    cfg = _cfg("qwen3_moe", experts=experts, k=k, width=32 if impl == "pallas" else 24)
    rng = np.random.default_rng(tokens * experts)
    bias = np.where(np.arange(experts) < k + 1, 20.0, -20.0) if skew else None
    lp, direction = _layer_weights(rng, cfg, bias)
    x = rng.normal(0, 1, (tokens, cfg.hidden_size))
    if skew:
        x += (1 + np.abs(rng.normal(0, 1, (tokens, 1)))) * direction
    x = x.astype(np.float32)
    jx = jnp.asarray(x)
    sizes = np.asarray(dispatch(jx, route_for(cfg, jx @ lp["router"]).experts, experts).group_sizes)
    assert sizes.sum() == tokens * k
    if skew:  # most experts idle, a few with many rows: empty groups and multi-tile groups
        assert (sizes == 0).sum() >= experts // 2 and sizes.max() >= tokens // 2
    got = jax.jit(lambda lp, x: moe_mlp(_in_kernel(lp) if impl == "pallas" else lp, x, cfg=cfg, impl=impl))(lp, jx)
    np.testing.assert_allclose(np.asarray(got), _np_moe(lp, x, cfg), rtol=1e-4, atol=1e-5)


def _largest_intermediate(jaxpr) -> int:
    """Elements of the largest value any equation produces, sub-computations (loops) included. An
    optimization barrier produces nothing: its outputs are its inputs (the weight stacks it ties to
    an expert index, quant/grouped.py `expert_weight`)."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars if eqn.primitive.name != "optimization_barrier" else ():
            best = max(best, math.prod(getattr(v.aval, "shape", ())))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            best = max(best, _largest_intermediate(sub))
    return best


def _dense_moe(lp, x, cfg):
    """Every expert on every token: the [T, X, F] product the grouped matmul must avoid."""
    r = route_for(cfg, x @ lp["router"])
    gate_up = jnp.einsum("te,xecf->txcf", x, lp["w_gate_up"])
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    y = jnp.einsum("txf,xfe->txe", h, lp["w_down"])
    return jnp.einsum("tke,tk->te", jnp.take_along_axis(y, r.experts[..., None], axis=1), r.weights)


def test_grouped_matmul_builds_no_dense_intermediate():
    """At a serving-like size (512 tokens, 128 experts, top-8) nothing of [T, X, F] size is built."""
    cfg = _cfg("qwen3_moe", experts=128, k=8)
    cfg = ModelConfig(**{**cfg.to_dict(), "hidden_size": 256, "moe_intermediate_size": 128})
    t, e, x, f = 512, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    lp = {"router": jax.ShapeDtypeStruct((e, x), jnp.float32),
          "w_gate_up": jax.ShapeDtypeStruct((x, e, 2, f), jnp.float32),
          "w_down": jax.ShapeDtypeStruct((x, f, e), jnp.float32)}
    h = jax.ShapeDtypeStruct((t, e), jnp.float32)
    dense_elems = t * x * f

    def measure(fn):
        jaxpr = jax.make_jaxpr(fn)(lp, h)
        temp = jax.jit(fn).lower(lp, h).compile().memory_analysis().temp_size_in_bytes
        return _largest_intermediate(jaxpr.jaxpr), temp

    # The check itself: the all-experts product trips both measures.
    largest, temp = measure(lambda lp, h: _dense_moe(lp, h, cfg))
    assert largest >= dense_elems and temp >= 4 * dense_elems
    largest, temp = measure(lambda lp, h: moe_mlp(lp, h, cfg=cfg, impl="tiled"))
    assert largest <= 2 * t * cfg.num_experts_per_tok * e  # O(assignments x hidden): a few [M, E] buffers
    assert largest < dense_elems / 2 and temp < 4 * dense_elems / 2


# ---- abstract construction of a real-size model ----------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_dummy_moe_model_constructs_abstractly(name):
    """Shapes only (no 60 GB allocation); the count agrees with HF's own model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from infire_jax.loaders.dummy import CONFIGS, load_dummy
    from infire_jax.models.registry import abstract_model

    cfg = load_dummy(name).config
    model = abstract_model(cfg, jnp.bfloat16)
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    n, e, x, f = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    expected = {"layers.router": ((n, e, x), ("layers", "embed", "router")),
                "layers.w_gate_up": ((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp")),
                "layers.w_down": ((n, x, f, e), ("layers", "experts", "mlp", "embed"))}
    for key, (shape, axes) in expected.items():
        assert params[key].shape == shape and params[key].axes == axes, key
        assert isinstance(params[key].get_value(), jax.ShapeDtypeStruct)  # nothing was allocated
    ours = sum(math.prod(v.shape) for v in params.values())

    hf_cfg = dict(CONFIGS[name])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg))
    assert ours == cfg.param_count() == sum(p.numel() for p in hf.parameters())


# ---- end to end against HF transformers -----------------------------------------------------------

def _save_tokenizer(path) -> None:
    """Byte-level BPE over the 256 byte symbols plus placeholder tokens, VOCAB in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<|extra_{i}|>": i for i in range(len(vocab), VOCAB)})
    tk = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    assert tk.get_vocab_size() == VOCAB
    tk.save(str(path / "tokenizer.json"))


def _hf_model(arch: str):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                  num_experts_per_tok=2, bos_token_id=256, eos_token_id=257, initializer_range=0.1)
    torch.manual_seed(0)
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=96, num_local_experts=8,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    else:  # Qwen3-MoE with its HF default: no renormalisation over the top-k
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=48,
                                                   num_experts=8, norm_topk_prob=False))
    return model.to(torch.float32).eval()


PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], [101] * 3 + [17, 230]]


@pytest.mark.parametrize("arch,grouped", [("mixtral", "tiled"), ("qwen3_moe", "tiled"), ("mixtral", "pallas")])
def test_generate_matches_hf(arch, grouped, tmp_path, monkeypatch):
    """`pallas`: the experts through the grouped kernel (the GPU's default), in Pallas interpret mode."""
    import torch

    from infire_jax import LLM, SamplingParams

    monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", grouped)
    hf = _hf_model(arch)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _save_tokenizer(tmp_path)

    llm = LLM(model=str(tmp_path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=64, num_kv_pages=32)
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (arch, 8, 2)
    if grouped == "pallas":
        from test_step_program import forward_jaxpr, kernel_names

        assert kernel_names(forward_jaxpr(llm.engine.runner, 4)).count("quant_matmul") == 2  # gate/up, down
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))

    hf.generation_config.eos_token_id = None  # decode all NUM_TOKENS, as ignore_eos does for ours
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        want = ref.sequences[0, len(prompt):].tolist()
        assert len(want) == NUM_TOKENS
        assert out.token_ids == want
        want_lp = [torch.log_softmax(step[0].double(), -1)[tok].item() for step, tok in zip(ref.logits, want)]
        got_lp = [lp[tok].logprob for lp, tok in zip(out.logprobs, want)]
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-3, rtol=0)
