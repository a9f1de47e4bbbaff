"""LoRA adapters through the engine, against HF transformers with the adapter applied by PEFT.

Adapters are made by PEFT itself (`init_lora_weights=False`: random nonzero A and B), ranks 8 and
64, every target module, on the default model (SmolLM2), a tiny random Llama (kept int8, with
n-gram speculative decoding; int4 at load, with a draft model), and a tiny Qwen3-MoE (attention
only). One SmolLM2 engine serves the offline tests and then the HTTP server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import socket
from unittest import mock

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from conftest import SMALL_ENGINE
from test_parity import PROMPTS as TEXTS

from infire_jax import LLM, BeamSearchParams, SamplingParams
from infire_jax.errors import InvalidRequestError
from infire_jax.lora import LoRARequest
from infire_jax.sample.beam_search import BeamSearch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
NUM_TOKENS = 48
# rank, lora_alpha, use_rslora, targets: ranks 8 and 64 on every module, two more for mixing and paging.
ADAPTERS = {"r8": (8, 16, False, ALL), "r64": (64, 4, True, ALL), "r16": (16, 32, False, ["q_proj", "v_proj"]),
            "r4": (4, 8, False, ["o_proj", "down_proj"])}
LORA_ENGINE = dict(SMALL_ENGINE, token_buckets=(4, 16, 64), enable_lora=True, max_loras=3, max_lora_rank=64)


def _greedy(n=NUM_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)


def _peft_model(base, adapters: dict, path) -> object:
    """PEFT adapters on `base` (random A and B, seeded), saved under path/<name>; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    model = None
    for i, (name, (r, alpha, rslora, targets)) in enumerate(adapters.items()):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    model.save_pretrained(str(path))
    assert all(os.path.isfile(os.path.join(path, n, "adapter_model.safetensors")) for n in adapters)
    return model.eval()


def _logprobs(out) -> list[float]:
    return [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def _assert_matches_peft(model, adapter: str | None, prompt: list[int], tokens: list[int],
                         logprobs: list[float]) -> None:
    """Our greedy tokens are HF + PEFT's greedy tokens, with their logprobs within 1e-3 (adapter None:
    the base model's). Checked in one forward over the prompt and our tokens: if HF's argmax after
    every prefix of ours is our next token, HF's own greedy decoding produces exactly our tokens (by
    induction over the steps)."""
    if adapter is not None:
        model.set_adapter(adapter)
    with torch.no_grad(), model.disable_adapter() if adapter is None else contextlib.nullcontext():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].double()
    assert logits.argmax(-1).tolist() == tokens
    want = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    np.testing.assert_allclose(logprobs, want.numpy(), atol=1e-3, rtol=0)


# ---- SmolLM2 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(tmp_path_factory, hf_smol):
    """The LoRA engine on SmolLM2, PEFT's model with the adapters, and the adapters' requests. PEFT
    wraps the model it is given in place: a copy of the session's HF model (transformers' load of the
    GGUF, float32), not another load of the GGUF (~25 s)."""
    base = copy.deepcopy(hf_smol)
    path = tmp_path_factory.mktemp("smol_lora")
    peft_model = _peft_model(base, ADAPTERS, path)
    llm = LLM(**LORA_ENGINE)
    requests = {name: LoRARequest(name, i + 1, str(path / name)) for i, name in enumerate(ADAPTERS)}
    return llm, peft_model, requests


def _prompts(llm) -> list[list[int]]:
    long = llm.tokenizer.encode(" ".join(TEXTS * 2))  # over the 64-token budget: prefilled in chunks
    return [llm.tokenizer.encode(TEXTS[0]), long]


def test_smollm2_adapters_match_peft(smol):
    """Rank 8 (a prompt prefilled in chunks) and rank 64 (rsLoRA's scale), every target module; the two
    in one batch, which decodes them in the same steps (a row's adapter reaching no other row is
    test_mixed_batch_rows_equal_alone's)."""
    llm, peft_model, requests = smol
    short, long = _prompts(llm)
    runs = (("r8", long), ("r64", short))
    outs = llm.generate([prompt for _, prompt in runs], _greedy(), lora_request=[requests[name] for name, _ in runs])
    for (name, prompt), out in zip(runs, outs):
        _assert_matches_peft(peft_model, name, prompt, out.token_ids, _logprobs(out))


def test_embeddings_through_adapters_match_peft(smol):
    """Embeddings (the shared flags run the pooling runner) through an adapter are PEFT's last hidden
    state at the prompt's last token, normalised; the base model's row in the same batch is its own."""
    llm, peft_model, requests = smol
    short, long = _prompts(llm)
    outs = llm.embed([long, short, short], lora_request=[requests["r8"], requests["r64"], None])
    for (adapter, prompt), out in zip((("r8", long), ("r64", short), (None, short)), outs):
        if adapter is not None:
            peft_model.set_adapter(adapter)
        with torch.no_grad(), peft_model.disable_adapter() if adapter is None else contextlib.nullcontext():
            h = peft_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1].double().numpy()
        np.testing.assert_allclose(out.outputs.embedding, h / np.linalg.norm(h), atol=1e-5)


def test_mixed_batch_rows_equal_alone(smol):
    """Three adapters and the base model in one batch: row i is bitwise what it is in a batch of the
    same shape whose every row runs row i's adapter (no row's adapter reaches another row), and what
    it is alone (the same tokens; logprobs within 1e-4: the base model's own float32 prefill differs
    by up to 1.4e-5 between a 9-token step and a 36-token one, whose matmuls block and sum differently,
    on XLA's dot as on the CPU matmul kernel; each adapter gives its row other tokens)."""
    llm, _, requests = smol
    prompt = _prompts(llm)[0]
    loras = [requests["r8"], requests["r64"], None, requests["r16"]]
    # 12 tokens: the prefill and three decode bursts of 4, every row's own tokens from the first.
    together = llm.generate([prompt] * len(loras), _greedy(12), lora_request=loras)
    assert len({tuple(o.token_ids) for o in together}) == 4
    for i, lora in enumerate(loras):
        uniform = llm.generate([prompt] * len(loras), _greedy(12), lora_request=lora)[i]
        assert together[i].token_ids == uniform.token_ids
        np.testing.assert_array_equal(_logprobs(together[i]), _logprobs(uniform))
        alone = llm.generate([prompt], _greedy(12), lora_request=lora)[0]
        assert together[i].token_ids == alone.token_ids
        np.testing.assert_allclose(_logprobs(together[i]), _logprobs(alone), atol=1e-4, rtol=0)
    assert llm.engine.compiles_since_warmup == 0


def test_more_adapters_than_slots_wait_for_one(smol):
    """Four adapters over three device slots: a request whose adapter finds every slot pinned waits,
    then is paged in (evicting an idle one); every row still gets what it gets alone, nothing compiles."""
    llm, _, requests = smol
    prompt = _prompts(llm)[0]
    loras = [requests["r8"], requests["r64"], requests["r16"], requests["r4"], None]
    together = llm.generate([prompt] * len(loras), _greedy(16), lora_request=loras)
    assert len({tuple(o.token_ids) for o in together}) == 5
    for lora, out in zip(loras, together):
        alone = llm.generate([prompt], _greedy(16), lora_request=lora)[0]
        assert out.token_ids == alone.token_ids
        np.testing.assert_allclose(_logprobs(out), _logprobs(alone), atol=1e-4, rtol=0)
    assert sorted(o.name for o in llm.engine.lora.slots.owner[1:] if o) != sorted(["r8", "r64", "r16"])
    assert llm.engine.compiles_since_warmup == 0


def test_prefix_cache_keys_on_the_adapter(smol):
    """Two adapters never share KV, nor an adapter and the base model; the same adapter does."""
    llm, _, requests = smol
    prompt = llm.tokenizer.encode("A unique prefix for the cache test. " * 6)
    cached = {}
    for key, lora in [("r8", requests["r8"]), ("r8 again", requests["r8"]), ("r64", requests["r64"]),
                      ("base", None)]:
        cached[key] = llm.generate([prompt], _greedy(2), lora_request=lora)[0].num_cached_tokens
    assert cached["r8"] == 0 and cached["r8 again"] >= 32 and cached["r64"] == 0 and cached["base"] == 0


def test_prompt_kv_moves_between_engines_with_its_adapter(smol):
    """A prompt's pages exported with adapter r8 come back (import, as a decode worker's) under r8's
    keys only: a request with r8 finds them and decodes as before; one with r64 does not."""
    llm, _, requests = smol
    engine = llm.engine
    prompt = llm.tokenizer.encode("Exported with its adapter: " * 8)
    before = llm.generate([prompt], _greedy(8), lora_request=requests["r8"])[0]
    blocks = engine.export_prompt_kv(prompt, lora_name="r8")
    assert blocks.num_blocks >= 2
    engine.kv.drop_cached()  # as if on another engine: nothing cached
    assert engine.import_prompt_kv(blocks, lora_name="r8") == blocks.num_blocks
    after = llm.generate([prompt], _greedy(8), lora_request=requests["r8"])[0]
    assert after.num_cached_tokens == blocks.num_blocks * engine.config.page_size
    assert after.token_ids == before.token_ids
    assert llm.generate([prompt], _greedy(2), lora_request=requests["r64"])[0].num_cached_tokens == 0
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.export_prompt_kv(prompt, lora_name="nobody")


def test_decode_worker_refuses_kv_of_another_adapter(smol):
    """A prefill worker's kv_transfer_params name the adapter the KV was computed with (its digest); a
    decode worker running the request on another adapter, or on the base model, refuses them (400)."""
    from infire_jax.engine.async_engine import AsyncEngine
    from server.errors import APIError
    from server.kv_handoff import KVHandoff, tokens_digest

    llm, _, _ = smol
    engine = llm.engine
    handoff = KVHandoff(AsyncEngine(engine, max_queue=0), "decode", buffer_bytes=1 << 20, host="127.0.0.1",
                        hold_seconds=1.0)
    layout, ps = engine.kv_layout, engine.config.page_size
    prompt = list(range(100, 100 + 2 * ps))
    layers, _, heads, dim = layout.page_shape
    params = {"layout": {"model": layout.model, "dtype": layout.dtype, "page_size": ps,
                         "page_shape": list(layout.page_shape), "v_page_shape": None, "kv_scales": layout.kv_scales},
              "num_tokens": 2 * ps, "tokens_digest": tokens_digest(prompt), "remote_engine_id": "x",
              "remote_address": 0, "num_bytes": layers * 2 * heads * dim * 4 * 2 * ps,
              "lora_digest": engine.lora.by_name["r8"].digest}
    assert handoff._check(params, prompt, "r8")[1] == 2 * ps
    for other in ("r64", None):
        with pytest.raises(APIError, match="another LoRA adapter"):
            handoff._check(params, prompt, other)


# ---- the server ------------------------------------------------------------------------------------

def _write_adapter(path, config: dict, tensors: dict) -> str:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def _bad_adapters(base, requests) -> dict[str, str]:
    """Adapter directories the server must refuse: rank too high, an unknown target, a wrong shape, a
    damaged file."""
    a = np.zeros((4, 576), np.float32)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]}
    out = {"rank": _write_adapter(base / "rank", {**config, "r": 128}, {f"{key}.lora_A.weight": a}),
           "target": _write_adapter(base / "target", {**config, "target_modules": ["lm_head"]}, {}),
           "shape": _write_adapter(base / "shape", config, {f"{key}.lora_A.weight": a,
                                                            f"{key}.lora_B.weight": np.zeros((575, 4), np.float32)})}
    damaged = _write_adapter(base / "damaged", config, {f"{key}.lora_A.weight": a})
    with open(os.path.join(damaged, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(20)
    out["damaged"] = damaged
    return out


async def _listen(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` listening on a free local port: its runner (to clean up) and its URL."""
    from server.listen import make_runner

    runner = make_runner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_server_serves_loads_and_unloads_adapters(smol, tmp_path):
    """--lora-modules, /v1/models, `model` selecting an adapter, loading one while a request runs, unloading,
    and bad input (400 / 404) with the server still up. Nothing compiles."""
    from server.app import build_app

    llm, _, requests = smol
    engine = llm.engine
    bad = _bad_adapters(tmp_path, requests)
    prompt = _prompts(llm)[0]
    want = {name: llm.generate([prompt], _greedy(16), lora_request=requests[name])[0].token_ids
            for name in ("r8", "r64")}
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4), lora_request=requests["r64"])
    want_beams = [llm.tokenizer.decode(b.tokens[len(prompt):]) for b in beams[0].sequences]
    compiles = engine.compiles_since_warmup

    async def scenario():
        runner, url = await _listen(build_app(engine, lora_modules=[("r8", requests["r8"].lora_path)]))
        got = {}
        try:
            async with aiohttp.ClientSession() as s:
                async def post(path, body):
                    async with s.post(url + path, json=body) as r:
                        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

                def completion(model, n=16):
                    return post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                    "temperature": 0, "ignore_eos": True})

                async with s.get(url + "/v1/models") as r:
                    got["models"] = (await r.json())["data"]
                got["r8"] = await completion("r8")
                running = asyncio.ensure_future(completion("r8", 40))  # runs while r64 is loaded
                got["load"] = await post("/v1/load_lora_adapter", {"lora_name": "r64",
                                                                   "lora_path": requests["r64"].lora_path})
                got["r64"] = await completion("r64")
                got["running"] = await running
                got["again"] = await post("/v1/load_lora_adapter", {"lora_name": "r64",
                                                                    "lora_path": requests["r64"].lora_path})
                got["no path"] = await post("/v1/load_lora_adapter", {"lora_name": "x"})
                got["missing"] = await post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
                for case, path in bad.items():
                    got[case] = await post("/v1/load_lora_adapter", {"lora_name": case, "lora_path": path})
                got["unload"] = await post("/v1/unload_lora_adapter", {"lora_name": "r64"})
                got["after unload"] = await completion("r64")
                got["unload again"] = await post("/v1/unload_lora_adapter", {"lora_name": "r64"})
                got["base"] = await completion(engine.model_name, 4)
                got["together"] = await asyncio.gather(*(  # loads running at once each take an id of their own
                    post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": requests[r].lora_path})
                    for name, r in (("t1", "r8"), ("t2", "r64"), ("t3", "r8"))))
                got["t2"] = await completion("t2")
                got["tokenize"] = await post("/tokenize", {"model": "t2", "prompt": "hi"})  # the base's tokenizer
                first_step, advance = asyncio.Event(), BeamSearch.advance

                def advanced(self, tops):
                    advance(self, tops)
                    first_step.set()

                with mock.patch.object(BeamSearch, "advance", advanced):  # t2 unloaded after the search's first step
                    search = asyncio.ensure_future(post("/v1/completions", {
                        "model": "t2", "prompt": prompt, "max_tokens": 4, "n": 2, "use_beam_search": True}))
                    await asyncio.wait([search, asyncio.ensure_future(first_step.wait())], timeout=120,
                                       return_when=asyncio.FIRST_COMPLETED)  # a search that fails at once ends it
                    got["unload t2"] = await post("/v1/unload_lora_adapter", {"lora_name": "t2"})
                    got["beams"] = await search
                async with s.get(url + "/health") as r:
                    got["health"] = r.status
        finally:
            await runner.cleanup()
        return got

    got = asyncio.run(scenario())
    cards = {m["id"]: m for m in got["models"]}
    assert cards["r8"]["parent"] == engine.model_name and cards["r8"]["root"] == requests["r8"].lora_path
    assert cards[engine.model_name]["parent"] is None
    for name in ("r8", "r64"):
        status, body = got[name]
        assert status == 200 and body["model"] == name
        assert body["choices"][0]["text"] == llm.tokenizer.decode(want[name])
    assert got["load"] == (200, "Success: LoRA adapter 'r64' added successfully.")
    assert got["running"][0] == 200 and got["unload"][0] == 200
    assert got["again"][0] == 400 and "already been loaded" in got["again"][1]["error"]["message"]
    assert got["no path"][0] == 400 and got["missing"][0] == 404
    messages = {"rank": "max_lora_rank", "target": "lm_head", "shape": "layer 0 q_proj",
                "damaged": "not a readable safetensors file"}
    for case, message in messages.items():
        status, body = got[case]
        assert status == 400 and message in body["error"]["message"], (case, body)
    assert got["after unload"][0] == 404 and got["unload again"][0] == 404
    assert got["base"][0] == 200 and got["health"] == 200
    assert [status for status, _ in got["together"]] == [200, 200, 200], got["together"]
    assert got["t2"][1]["choices"][0]["text"] == llm.tokenizer.decode(want["r64"])
    assert got["unload t2"][0] == 200 and got["beams"][0] == 200, got["beams"]  # the search finished on t2
    assert [c["text"] for c in got["beams"][1]["choices"]] == want_beams
    ids = llm.tokenizer.encode("hi")
    assert got["tokenize"] == (200, {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                                     "token_strs": None})
    assert engine.compiles_since_warmup == compiles


def test_served_model_aliases(smol):
    """--served-model-name NAME ALIAS (vLLM's): /v1/models lists both, a request may name either and is
    answered as NAME's, the same text; an adapter may not take an alias; /tokenize takes it; /metrics
    labels the model once, by NAME. Nothing compiles."""
    from server.app import build_app

    llm, _, requests = smol
    engine = llm.engine
    prompt = _prompts(llm)[0]
    compiles = engine.compiles_since_warmup

    async def scenario():
        runner, url = await _listen(build_app(engine, model_names=["smol"], aliases={"smol": ["smol-alias"]},
                                              lora_modules=[("r8", requests["r8"].lora_path)]))
        got = {}
        try:
            async with aiohttp.ClientSession() as s:
                async def post(path, body):
                    async with s.post(url + path, json=body) as r:
                        return r.status, await r.json()

                async with s.get(url + "/v1/models") as r:
                    got["models"] = (await r.json())["data"]
                for model in ("smol", "smol-alias", "r8"):
                    got[model] = await post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6,
                                                                "temperature": 0})
                got["chat"] = await post("/v1/chat/completions", {"model": "smol-alias", "max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})
                got["embed"] = await post("/v1/embeddings", {"model": "smol-alias", "input": "Hi"})
                got["tokenize"] = await post("/tokenize", {"model": "smol-alias", "prompt": "hi"})
                got["load alias"] = await post("/v1/load_lora_adapter", {"lora_name": "smol-alias",
                                                                         "lora_path": requests["r64"].lora_path})
                got["unknown"] = await post("/v1/completions", {"model": "other", "prompt": "Hi"})
                async with s.get(url + "/metrics") as r:
                    got["metrics"] = await r.text()
        finally:
            await runner.cleanup()
        return got

    got = asyncio.run(scenario())
    assert [(m["id"], m["root"], m["parent"]) for m in got["models"]] == [
        ("smol", "smol", None), ("smol-alias", "smol", None), ("r8", requests["r8"].lora_path, "smol")]
    for name, answered in (("smol", "smol"), ("smol-alias", "smol"), ("r8", "r8"), ("chat", "smol"),
                           ("embed", "smol")):
        assert got[name][0] == 200 and got[name][1]["model"] == answered, (name, got[name])
    assert got["smol-alias"][1]["choices"][0]["text"] == got["smol"][1]["choices"][0]["text"]
    assert got["r8"][1]["choices"][0]["text"] != got["smol"][1]["choices"][0]["text"]
    assert got["tokenize"] == (200, {"count": len(llm.tokenizer.encode("hi")), "max_model_len": engine.max_model_len,
                                     "tokens": llm.tokenizer.encode("hi"), "token_strs": None})
    assert got["load alias"][0] == 400 and "already been loaded" in got["load alias"][1]["error"]["message"]
    assert got["unknown"][0] == 404 and "`smol`, `smol-alias`, `r8`" in got["unknown"][1]["error"]["message"]
    assert 'model_name="smol"' in got["metrics"] and "smol-alias" not in got["metrics"]
    assert engine.compiles_since_warmup == compiles


# ---- tiny models: int8 / int4 base weights with n-gram / draft-model speculation, a mixture of experts

def _int8_round_trip(model) -> None:
    """The HF model's layer weights as our int8 keeps them (quant/resident.py's quantize_channels, redone in
    HF's layout): one scale per output row (o_proj: per output row and head), absmax / 127, rint."""
    heads = model.config.num_attention_heads
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("proj.weight") or ".layers." not in name:
                continue
            w = p.detach().double().numpy()
            groups = w.reshape(w.shape[0], heads, -1) if "o_proj" in name else w[:, None, :]
            scale = np.abs(groups).max(axis=-1, keepdims=True).astype(np.float32) / np.float32(127)
            scale = np.where(scale == 0, 1, scale).astype(np.float32)
            q = np.clip(np.rint(groups.astype(np.float32) / scale), -127, 127)
            p.copy_(torch.from_numpy((q * scale).astype(np.float32).reshape(w.shape)))


def test_tiny_llama_int8_with_ngram_speculation_matches_peft(tmp_path):
    """A small vocabulary and small weights make the model repeat itself, so n-gram proposals are
    made and some accepted: the verifying steps' logits come from the rows' adapters."""
    from test_moe import PROMPTS as ID_PROMPTS
    from test_moe import VOCAB, _save_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.05, tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _int8_round_trip(base)  # the checkpoint is already int8-exact, so HF computes with our kept weights
    base.save_pretrained(tmp_path / "model", safe_serialization=True)
    _save_tokenizer(tmp_path / "model")
    peft_model = _peft_model(base, {"r8": ADAPTERS["r8"], "r64": ADAPTERS["r64"]}, tmp_path / "adapters")
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=256, num_kv_pages=72, weights_quantization="int8",
              enable_lora=True, max_loras=2, max_lora_rank=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    prompts = ID_PROMPTS[:2]
    for i, name in enumerate(("r8", "r64")):
        request = LoRARequest(name, i + 1, str(tmp_path / "adapters" / name))
        for prompt, out in zip(prompts, llm.generate(prompts, _greedy(32), lora_request=request)):
            _assert_matches_peft(peft_model, name, prompt, out.token_ids, _logprobs(out))
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the target verified the rows' proposals
    assert llm.engine.compiles_since_warmup == 0


def _int4_round_trip(model, group: int) -> None:
    """The HF model's layer weights as int4 at load keeps them ((q - zero) * scale of the float64
    reference quantizer, per output row in groups of `group` of HF's inputs)."""
    from quant_reference import reference_rtn

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") and ".layers." in name:
                q, zero, scale = reference_rtn(p.detach().numpy(), group)
                p.copy_(torch.from_numpy(((q - zero) * scale.astype(np.float64)).astype(np.float32)))


def test_tiny_llama_int4_with_draft_model_matches_peft(tmp_path):
    """Int4 at load (groups of 32; o_proj's kept per head of 16) under a draft model: the float
    checkpoint drafts without adapters for rows of two adapters and the base in one batch, and the
    int4 target verifies each row with its adapter. Every row is HF + PEFT's on the int4-dequantized
    weights; the same rows with speculation off (a batch past disable_by_batch_size) are the same
    tokens; nothing stays pinned or allocated."""
    from test_moe import PROMPTS as ID_PROMPTS
    from test_moe import VOCAB, _save_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.05, tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "model", safe_serialization=True)  # float: the engine quantizes it
    _save_tokenizer(tmp_path / "model")
    _int4_round_trip(base, 32)
    peft_model = _peft_model(base, {"r8": ADAPTERS["r8"], "r64": ADAPTERS["r64"]}, tmp_path / "adapters")
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=96, num_kv_pages=32, weights_quantization="int4",
              int4_group_size=32, enable_lora=True, max_loras=2, max_lora_rank=64,
              speculative_config={"method": "draft_model", "model": str(tmp_path / "model"),
                                  "num_speculative_tokens": 3, "disable_by_batch_size": 3})
    e = llm.engine
    names = ["r8", "r64", None]
    loras = [LoRARequest(n, i + 1, str(tmp_path / "adapters" / n)) if n else None for i, n in enumerate(names)]
    prompts = ID_PROMPTS[:3]
    outs = llm.generate(prompts, _greedy(24), lora_request=loras)
    for name, prompt, out in zip(names, prompts, outs):
        _assert_matches_peft(peft_model, name, prompt, out.token_ids, _logprobs(out))
    stats = e.spec.stats
    drafts, accepted = stats.num_drafts, stats.num_accepted_tokens
    assert drafts > 0 and 0 < accepted < stats.num_draft_tokens  # proposals both accepted and rejected
    plain = llm.generate(prompts + [prompts[0]], _greedy(24), lora_request=loras + [None])  # 4 rows > 3: no drafts
    assert stats.num_drafts == drafts
    assert [o.token_ids for o in plain[:3]] == [o.token_ids for o in outs]
    assert e.kv.num_free_pages == e.kv.num_usable_pages and e.lora.slots.num_pinned == 0
    assert all(a.users == 0 for a in e.lora.by_name.values())
    assert e.compiles_since_warmup == 0


def test_tiny_qwen3_moe_attention_adapters_match_peft(tmp_path):
    from test_moe import PROMPTS as MOE_PROMPTS
    from test_moe import _hf_model, _save_tokenizer

    base = _hf_model("qwen3_moe")
    base.save_pretrained(tmp_path / "model", safe_serialization=True)
    _save_tokenizer(tmp_path / "model")
    adapters = {"attn8": (8, 2, False, ATTENTION), "attn64": (64, 4, True, ATTENTION)}
    peft_model = _peft_model(base, adapters, tmp_path / "adapters")
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=96, num_kv_pages=32, enable_lora=True, max_loras=2,
              max_lora_rank=64)
    requests = [LoRARequest(n, i + 1, str(tmp_path / "adapters" / n)) for i, n in enumerate(adapters)]
    for request in requests:
        for prompt, out in zip(MOE_PROMPTS, llm.generate(MOE_PROMPTS, _greedy(), lora_request=request)):
            _assert_matches_peft(peft_model, request.lora_name, prompt, out.token_ids, _logprobs(out))
    mlp = tmp_path / "adapters" / "attn8"  # the same adapter, claiming the (expert) MLP's gate_proj too
    config = json.loads((mlp / "adapter_config.json").read_text())
    (mlp / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ATTENTION + ["gate_proj"]}))
    with pytest.raises(InvalidRequestError, match="mixture of experts"):
        llm.generate(MOE_PROMPTS[:1], _greedy(2), lora_request=LoRARequest("mlp", 9, str(mlp)))


# ---- tensor and pipeline parallelism ---------------------------------------------------------------

def test_sharded_adapters_match_one_device_and_peft(tmp_path, smol_llm):
    """tp=4 over 2 kv heads (each kv head's B repeated, as the weight's) times pp=2 (3 layers, a padding
    layer): the same tokens as one device, whose tokens are HF + PEFT's."""
    from test_sharding import ENGINE, PROMPTS, _results, _run_worker
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=smol_llm.tokenizer.vocab_size, hidden_size=128, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path / "model", safe_serialization=True)
    smol_llm.tokenizer.save(str(tmp_path / "model"))
    peft_model = _peft_model(base, {"r8": ADAPTERS["r8"]}, tmp_path / "adapters")
    configs = os.path.join(os.path.dirname(__file__), "..", "sharding", "configs")
    meshes = [os.path.join(configs, m) for m in ("1.yaml", "8-tp4-pp2.yaml")]
    # One bucket, one decode step a launch: what is checked here is the adapters' layout on the mesh; decode bursts
    # and the small bucket on meshes are test_sharding's (each is another program every engine compiles). The steps
    # are the same: the scheduler chunks by the 32-token budget, not by the buckets.
    engine = {**ENGINE, "token_buckets": [32], "num_decode_steps": 1, "enable_lora": True, "max_lora_rank": 8}
    job = {"runs": [{"model": str(tmp_path / "model"), "mesh": m} for m in meshes], "prompts": PROMPTS,
           "max_tokens": 16, "engine": engine,
           "lora": ["r8", 1, str(tmp_path / "adapters" / "r8")]}
    single, sharded = _results(_run_worker(job, 8, tmp_path, "lora"))
    assert single["fits"] and sharded["fits"], sharded.get("error")
    assert sharded["tokens"] == single["tokens"]
    np.testing.assert_allclose(np.asarray(sharded["logprobs"]), np.asarray(single["logprobs"]), atol=1e-4)
    for text, tokens, logprobs in zip(PROMPTS, single["tokens"], single["logprobs"]):
        _assert_matches_peft(peft_model, "r8", smol_llm.tokenizer.encode(text), tokens, logprobs)
