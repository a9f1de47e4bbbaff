"""The bfloat16 panel matmul through oneDNN (pallas_kernels/cpu_onednn.py), the path of AMX CPUs: the
call against float64 for ragged row counts (every remainder of oneDNN's 16- and 32-row tiles, one row,
a prefill), layers of a stack read in place, where `panel_matmul` hands a step to it, that it is chosen
by itself exactly where the CPU has AMX, and the default model in bfloat16 generating the same tokens
through it as through the hand-written kernel.

The suite keeps oneDNN off elsewhere (conftest: other tests hold the hand-written kernels to bitwise
sums); here it is forced on, which on a CPU without AMX runs oneDNN's AVX-512 kernels and on one with
AMX its tile kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_kernels, cpu_matmul, cpu_onednn
from test_cpu_matmul import needs_bf16_dot

pytestmark = [needs_bf16_dot, pytest.mark.usefixtures("models_choose_cpu_kernels")]


@pytest.fixture(autouse=True)
def onednn_forced(monkeypatch):
    if cpu_onednn.library() is None:
        pytest.fail("the oneDNN call did not build: onednn-cpu-gomp and onednn-devel-cpu-gomp are dependencies")
    monkeypatch.delenv("INFIRE_JAX_NO_ONEDNN", raising=False)
    monkeypatch.setenv("INFIRE_JAX_FORCE_ONEDNN", "1")


def _bf16(rng, shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 17, 31, 33, 64, 517])
@pytest.mark.parametrize("k,n", [(32, 32), (576, 1536), (1536, 576), (96, 224)])
def test_onednn_panel_matmul_matches_float64(rows, k, n):
    """x @ w[layer] for the first and last layer of a stack of panels, within float32 summation of the
    exact bfloat16 products (float64 of the same values; the bound is 1e-5 of the sum of magnitudes)."""
    rng = np.random.default_rng(rows * 7 + k + n)
    x, w = _bf16(rng, (rows, k)), _bf16(rng, (3, k, n))
    panels = jax.jit(cpu_matmul.pack_panels)(w)
    call = jax.jit(cpu_onednn.panel_matmul)
    for layer in (0, 2):
        got = np.asarray(call(x, panels, jnp.int32(layer)))
        xf, wf = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w[layer].astype(jnp.float32), np.float64)
        want, scale = xf @ wf, np.abs(xf) @ np.abs(wf)
        assert got.shape == (rows, n) and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), float(np.max(np.abs(got - want) / scale))


def _calls_onednn(rows: int, panels: jax.Array) -> bool:
    x = jnp.zeros((rows, panels.shape[2] * (2 if panels.dtype == jnp.bfloat16 else 1)), panels.dtype)
    return cpu_onednn.TARGET in jax.jit(cpu_matmul.panel_matmul).lower(x, panels, jnp.int32(0)).as_text()


def test_panel_matmul_hands_bf16_steps_of_two_or_more_rows_to_onednn(monkeypatch):
    bf16 = cpu_matmul.pack_panels(jnp.zeros((1, 64, 32), jnp.bfloat16))
    assert _calls_onednn(cpu_onednn.MIN_ROWS, bf16) and _calls_onednn(512, bf16)
    assert not _calls_onednn(1, bf16)  # batch-1 decode keeps the hand-written kernel
    assert not _calls_onednn(8, cpu_matmul.pack_panels(jnp.zeros((1, 48, 32), jnp.bfloat16)))  # K not blocked
    assert not _calls_onednn(8, cpu_matmul.pack_panels(jnp.zeros((1, 64, 32), jnp.float32)))
    monkeypatch.setenv("INFIRE_JAX_NO_ONEDNN", "1")
    assert not _calls_onednn(8, bf16)


def test_onednn_is_chosen_by_itself_exactly_where_the_cpu_has_amx(monkeypatch):
    """Without the forcing switch, oneDNN is chosen iff the CPU lists AMX's tiles and bfloat16 dot
    (oneDNN's own dispatch agrees with /proc/cpuinfo)."""
    monkeypatch.delenv("INFIRE_JAX_FORCE_ONEDNN")
    flags = cpu_kernels.host_cpu().split()
    has_amx = "amx_bf16" in flags and "amx_tile" in flags
    assert cpu_onednn.amx() == has_amx and cpu_onednn.chosen() == has_amx
    assert cpu_onednn.isa().startswith("avx512_core_amx" if has_amx else "avx512_core_bf16")


def test_onednn_leaves_openmp_workers_keeping_denormals():
    """A 517-row call starts OpenMP's workers (oneDNN parallelizes it) from inside XLA, which flushes
    denormals; libgomp is one per process (torch's here), so workers made under that flag would flush
    every later OpenMP caller's denormals too (torch's references among them). The call runs with the
    default floating-point environment: torch's parallel product still gives subnormals after it."""
    import torch

    panels = cpu_matmul.pack_panels(jnp.ones((1, 32, 32), jnp.bfloat16))
    jax.block_until_ready(jax.jit(cpu_onednn.panel_matmul)(jnp.ones((517, 32), jnp.bfloat16), panels, jnp.int32(0)))
    tiny = torch.full((1 << 21,), 1e-39, dtype=torch.float32) * 0.5  # parallel over OpenMP's workers
    assert bool((tiny != 0).all()), f"{int((tiny == 0).sum())} of {tiny.numel()} denormals flushed"


def test_onednn_panel_matmul_refuses_what_it_cannot_read():
    panels = cpu_matmul.pack_panels(jnp.zeros((1, 48, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="a multiple of 32"):
        cpu_onednn.panel_matmul(jnp.zeros((2, 48), jnp.bfloat16), panels, jnp.int32(0))
    with pytest.raises(ValueError, match="bfloat16 x and panels"):
        cpu_onednn.panel_matmul(jnp.zeros((2, 64), jnp.float32),
                                cpu_matmul.pack_panels(jnp.zeros((1, 64, 32), jnp.float32)), jnp.int32(0))


def test_gemm_benchmark_runs(capsys):
    """`python -m infire_jax.bench.cpu_gemm` (the GEMM table in docs/PERFORMANCE.md) end to end: every
    weight shape and step size with a rate in each column, and oneDNN's ISA named."""
    from infire_jax.bench import cpu_gemm

    assert cpu_gemm.main(["--rows", "1", "64", "--iters", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"oneDNN: {cpu_onednn.isa()}") and lines[1].split()[:2] == ["model", "weight"]
    assert [ln.split()[1] + ln.split()[4] for ln in lines[2:]] == [
        f"{w}{m}" for w in ("wqkv", "wo", "w_gate_up", "w_down") for m in (1, 64)]
    assert all(float(rate) > 0 for ln in lines[2:] for rate in ln.split()[5:8])


def _prompt_logprobs(outs) -> np.ndarray:
    return np.concatenate([[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs])


def test_the_default_model_in_bf16_through_onednn_is_as_close_to_float32_as_without(monkeypatch):
    """The real model in bfloat16, three prompts batched (32-token prefill steps and 3-row decode steps
    through oneDNN), against the float32 model:
    - teacher-forced on the float32 model's greedy continuations, each token's logprob is as close to
      float32's through oneDNN as through the hand-written kernel (bfloat16 rounds each layer's output,
      so both stray from float32 by up to ~0.25, ~0.03 on average; a wrong sum strays far more);
    - greedy, the tokens equal the hand-written kernel's up to a near-tie: where the two first part,
      the hand-written run's own top two hold both tokens within 0.25.
    The programs are traced through the oneDNN call (counted) only when it is forced."""
    from infire_jax import LLM, SamplingParams

    traced = []
    real = cpu_onednn.panel_matmul
    monkeypatch.setattr(cpu_onednn, "panel_matmul", lambda *a: traced.append(a[0].shape) or real(*a))
    monkeypatch.setenv("INFIRE_JAX_NO_CHECKPOINT", "1")
    monkeypatch.setenv("INFIRE_JAX_NO_EXECUTABLE_CACHE", "1")  # trace every program (what `traced` counts)
    prompts = ["The capital of France is", "Once upon a time,", "def add(a, b):"]
    texts, forced, greedy = None, {}, {}
    for mode in ("float32", "onednn", "hand-written"):
        monkeypatch.setenv("INFIRE_JAX_NO_ONEDNN" if mode == "hand-written" else "INFIRE_JAX_FORCE_ONEDNN", "1")
        traced.clear()
        llm = LLM(dtype="float32" if mode == "float32" else "bfloat16", max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=128, token_buckets=[4, 32], num_kv_pages=32)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2))
        texts = texts or [p + o.outputs[0].text for p, o in zip(prompts, outs)]
        greedy[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        forced[mode] = _prompt_logprobs(llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0)))
        llm.engine.close()
        assert bool(traced) == (mode == "onednn") and all(rows >= cpu_onednn.MIN_ROWS for rows, _ in traced)

    off = {mode: np.abs(forced[mode] - forced["float32"]) for mode in ("onednn", "hand-written")}
    assert off["onednn"].mean() <= 1.25 * off["hand-written"].mean() + 0.005, {m: d.mean() for m, d in off.items()}
    assert off["onednn"].max() <= 1.5 * off["hand-written"].max() + 0.05, {m: d.max() for m, d in off.items()}
    agreed = 0
    for (tokens, _), (want_tokens, want_logprobs) in zip(greedy["onednn"], greedy["hand-written"]):
        for i, (token, want) in enumerate(zip(tokens, want_tokens)):
            if token != want:
                gap = want_logprobs[i][want].logprob - (want_logprobs[i][token].logprob if token in want_logprobs[i]
                                                         else -np.inf)
                assert gap <= 0.25, (i, token, want)
                break
            agreed += 1
    assert agreed >= 24  # most of the 48 tokens: a swap is rare
