"""Shared fixtures: the real default model (ours and HF's), and a small engine on it."""

from __future__ import annotations

import os

import pytest

# Small enough to compile quickly on 2 CPU cores, big enough for batches and chunked prefill.
SMALL_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from infire_jax.loaders.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_llm():
    from infire_jax import LLM

    return LLM(**SMALL_ENGINE)


@pytest.fixture(scope="session")
def hf_smol(default_gguf):
    """HF transformers' own load of the same GGUF, in float32: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture
def cpu_device():
    """Runs a test on the CPU device, kernel choices included (`pallas_kernels.placement`): CPU-kernel
    tests then check the CPU path on a GPU machine too; where the CPU is the default, nothing changes."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield
