"""Gemma 3's images (vision/gemma3_encoder.py, vision/gemma3_inputs.py) against transformers'
Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil and Gemma3Processor, through the real engine.

A tiny random multimodal checkpoint (test_gemma3.py's language model; a two-layer SigLIP tower of
56-pixel images in 7-pixel patches, an 8 x 8 grid average-pooled 4 x 4 into 4 tokens; random norms and
projector) is saved by transformers with a tokenizer whose `<start_of_image>`, `<end_of_image>` and
`<image_soft_token>` are special tokens. The pixels, the tower's outputs and the expanded prompts must
equal transformers'; greedy tokens and logprobs through the engine equal transformers' language model on
the same embeddings with its causal mask (what the engine serves, as vLLM does; docs/SERVER.md); a chat
over HTTP answers as offline; tp and pp meshes answer as one device.
"""

from __future__ import annotations

import base64
import io
import json
import os

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from deepseek_models import VOCAB, _save_tokenizer
from test_gemma3 import ENGINE, TINY, hf_model

from infire_jax.vision import gemma3_inputs, towers

RNG = np.random.default_rng(7)
BOI, EOI, SOFT = VOCAB - 3, VOCAB - 2, VOCAB - 1
SPECIAL = {gemma3_inputs.BOI: BOI, gemma3_inputs.EOI: EOI, gemma3_inputs.SOFT: SOFT}
TOKENS = 4  # mm_tokens_per_image
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=7, vision_use_head=False)
# Gemma's chat template's shape: a turn per message, an image part as <start_of_image>, text parts in a row.
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _image(h: int, w: int) -> Image.Image:
    return Image.fromarray(RNG.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _name_special_tokens(path) -> None:
    """The byte-level tokenizer's last three ids renamed to Gemma 3's image tokens and made special."""
    from tokenizers import AddedToken, Tokenizer

    file = path / "tokenizer.json"
    data = json.loads(file.read_text())
    for text, i in SPECIAL.items():
        data["model"]["vocab"][text] = data["model"]["vocab"].pop(f"<|extra_{i}|>")
    file.write_text(json.dumps(data))
    tk = Tokenizer.from_file(str(file))
    tk.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in SPECIAL])
    tk.save(str(file))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the multimodal HF model, its causal language model, its saved directory)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    lm = hf_model()
    config = Gemma3Config(text_config={k: v for k, v in TINY.items() if k != "eos_token_id"}, vision_config=VISION,
                          mm_tokens_per_image=TOKENS, eos_token_id=TINY["eos_token_id"], image_token_index=SOFT,
                          boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(1)
    mm = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    mm.model.language_model.load_state_dict(lm.model.state_dict())
    with torch.no_grad():  # HF starts the projector at zero and the norms at one (or zero: Gemma's 1 + w)
        for name, p in mm.model.named_parameters():
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.2))
    path = tmp_path_factory.mktemp("gemma3_images")
    mm.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    _name_special_tokens(path)
    return mm, lm, path


@pytest.fixture(scope="module")
def processor(checkpoint):
    """transformers' Gemma3Processor with its PIL image processor at the published defaults (bilinear,
    mean and std 0.5), the tower's size, pan-and-scan off."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    path = checkpoint[2]
    tk = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), extra_special_tokens=dict(
        boi_token=gemma3_inputs.BOI, eoi_token=gemma3_inputs.EOI, image_token=gemma3_inputs.SOFT))
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Gemma3Processor(image_processor=images, tokenizer=tk, chat_template=TEMPLATE, image_seq_length=TOKENS)


@pytest.fixture(scope="module")
def llm(checkpoint):
    from infire_jax import LLM

    llm = LLM(model=str(checkpoint[2]), **{**ENGINE, "token_buckets": (4, 32)}, limit_mm_per_prompt={"image": 2})
    yield llm
    llm.engine.close()


IMAGES = [(40, 40), (56, 112), (90, 30)]  # square, wide, tall: each resized to the 56-pixel square


def test_pixels_equal_the_image_processors(processor):
    for h, w in IMAGES:
        image = _image(h, w)
        want = processor.image_processor(image, return_tensors="np")["pixel_values"]
        got = gemma3_inputs.tiles(image, 56)
        assert got.grid == (1, 1) and got.pixels.dtype == np.float32
        np.testing.assert_array_equal(got.pixels, want)


def test_tower_and_projector_equal_get_image_features(checkpoint, processor):
    """float32, three images of different sizes; the checkpoint's tensors read by the loader (transformers
    5's names) and as Google published them (`vision_tower.vision_model.*`) and transformers 4.5x saved
    them (the same under `model.`) give the same weights."""
    from infire_jax.loaders.vision import load_vision_tower
    from infire_jax.vision.gemma3_encoder import Gemma3VisionConfig, encode_images, weights_from_hf

    mm, _, path = checkpoint
    cfg, tensors = load_vision_tower(str(path))
    assert isinstance(cfg, Gemma3VisionConfig) and (cfg.tokens_per_image, cfg.pool_kernel) == (TOKENS, 4)
    assert cfg.image_token_id == SOFT and cfg.text_hidden_size == TINY["hidden_size"]
    weights = weights_from_hf(cfg, tensors)
    published = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in tensors.items()}
    for names in (published, {f"model.{k}": v for k, v in published.items()}):
        same = weights_from_hf(cfg, names)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(same)))
    pixels = np.concatenate([gemma3_inputs.tiles(_image(h, w), 56).pixels for h, w in IMAGES])
    with torch.no_grad():
        want = mm.get_image_features(torch.from_numpy(pixels), return_dict=True).pooler_output.numpy()
    got = np.asarray(encode_images(cfg, weights, pixels))
    assert got.shape == want.shape == (3, TOKENS, TINY["hidden_size"])
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    one = np.asarray(towers.encode_padded(cfg, weights, pixels[1:2]))  # the engine's jitted call, one image
    np.testing.assert_allclose(one[0], want[1], atol=2e-5, rtol=1e-5)
    # the bytes the engine leaves the tower when it sizes the KV pool from device memory: every weight's
    assert towers.device_bytes(cfg, np.float32)[0] == sum(a.nbytes for a in jax.tree.leaves(weights))


def _hf_greedy(mm, lm, ids: list[int], pixels: np.ndarray, num_tokens: int):
    """transformers' greedy tokens and float64 logprobs, causally: its language model (Gemma3ForCausalLM,
    causal attention by construction) on its own embeddings with the image tokens' replaced by
    `get_image_features`, as Gemma3Model's forward merges them. The wrapper with token_type_ids would
    let an image's tokens see each other (the test checks that this differs)."""
    lm.generation_config.eos_token_id = None
    with torch.no_grad():
        features = mm.get_image_features(torch.from_numpy(pixels), return_dict=True).pooler_output
        ids_t = torch.tensor([ids])
        embeds = lm.get_input_embeddings()(ids_t)
        images = (ids_t == SOFT)[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(images, features.reshape(-1, TINY["hidden_size"]))
        out = lm.generate(inputs_embeds=embeds, max_new_tokens=num_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        causal = mm(input_ids=ids_t, pixel_values=torch.from_numpy(pixels)).logits[0, -1]
        bidirectional = mm(input_ids=ids_t, pixel_values=torch.from_numpy(pixels),
                           token_type_ids=(ids_t == SOFT).long()).logits[0, -1]
    np.testing.assert_allclose(causal.numpy(), out.logits[0][0].numpy(), atol=1e-4)  # the wrapper without them: causal
    assert not torch.allclose(causal, bidirectional, atol=1e-3)
    want = out.sequences[0].tolist()
    return want, [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, want)]


def test_generate_with_images_equals_transformers(checkpoint, processor, llm):
    """Text prompts with `<start_of_image>` markers expand to Gemma3Processor's input_ids; their greedy
    tokens and logprobs (and the same prompts as token ids) equal transformers' causal run within 1e-3.
    The long prompt's image spans two 32-token prefill chunks; nothing compiles while serving."""
    from infire_jax import SamplingParams
    from infire_jax.runner.compile_guard import compile_count

    mm, lm, _ = checkpoint
    square, wide, tall = (_image(h, w) for h, w in IMAGES)
    cases = [("look:<start_of_image>", [square]), ("x" * 25 + "<start_of_image>and<start_of_image>?", [wide, tall])]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    free, compiles = llm.engine.images.pool.free_rows, compile_count()
    for text, images in cases:
        theirs = processor(text=text, images=images, return_tensors="np")
        ids = theirs["input_ids"][0].tolist()
        assert ids.count(SOFT) == TOKENS * len(images)
        tokens, lps = _hf_greedy(mm, lm, ids, theirs["pixel_values"].astype(np.float32), 12)
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}},
                             {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params)
        for out in outs:
            assert out.prompt_token_ids == ids
            assert out.outputs[0].token_ids == tokens
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)], lps,
                                       atol=1e-3, rtol=0)
    assert compile_count() == compiles
    assert llm.engine.images.pool.free_rows == free == llm.engine.images.pool.num_rows


def test_chat_prompt_equals_the_processors(processor, llm):
    """LLM.chat with text and image parts renders and expands as Gemma3Processor's apply_chat_template
    (the template takes the parts: loaders/chat_content.py), and a prompt whose markers and images
    disagree is refused by name."""
    from infire_jax import SamplingParams
    from infire_jax.errors import InvalidRequestError

    image = _image(64, 48)
    ours = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                         {"type": "text", "text": "what is it?"}]}]
    theirs = [ours[0], {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                                    {"type": "text", "text": "what is it?"}]}]
    text = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=False)
    want = processor(text=text, images=[image], return_tensors="np")["input_ids"][0].tolist()
    out = llm.chat(ours, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == want
    with pytest.raises(InvalidRequestError, match="1 <start_of_image> markers for 2 images"):
        llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": [image, image]}},
                     SamplingParams(max_tokens=1))


def test_chat_over_http_equals_offline(llm):
    """A chat message with a PNG data URL answers as the offline engine on the same expanded prompt (the
    template takes the message's parts: the text and the image's marker in a row, as transformers renders
    them)."""
    import urllib.request

    from server_utils import AppThread

    from infire_jax import SamplingParams
    from server.app import build_app

    image = _image(56, 80)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    prompt = "<start_of_turn>user\nlook:<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    want = llm.generate({"prompt": prompt, "multi_modal_data": {"image": Image.open(png)}},
                        SamplingParams(max_tokens=8, temperature=0))[0]
    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(llm.engine)))
        body = {"model": llm.engine.model_name, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image_url",
                                                                           "image_url": {"url": url}}]}]}
        req = urllib.request.Request(servers.urls[0] + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "x-tenant-id": "http"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.load(r)
    finally:
        servers.close()
    assert got["choices"][0]["message"]["content"] == want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_processor_configs_it_does_not_implement_are_refused(processor):
    """transformers' own preprocessor config (the published defaults) is taken; pan-and-scan, another
    normalization or size is refused naming the field."""
    from infire_jax.errors import UnsupportedModelError

    pp = processor.image_processor.to_dict()
    gemma3_inputs.check_processor(pp, 56)
    for field, value in [("do_pan_and_scan", True), ("image_mean", [0.48, 0.45, 0.4]), ("resample", 3),
                         ("size", {"height": 896, "width": 896})]:
        with pytest.raises(UnsupportedModelError, match=field):
            gemma3_inputs.check_processor({**pp, field: value}, 56)


def test_images_on_tp_and_pp_meshes_match_one_device(checkpoint, tmp_path):
    """On 2 virtual CPU devices (tp 2, a pipeline of 2 stages) the tower and the pool are replicated, as
    Llama 4's (tests/test_vision_mesh.py), each device holding the bytes `infire-jax plan` counts: one
    device's greedy tokens, its logprobs within 1e-4."""
    from test_sharding import ROOT, _results, _run_worker

    from infire_jax.memplan.plan import memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import MeshConfig

    paths = []
    for name, (h, w) in (("wide", (56, 112)), ("small", (40, 40))):
        paths.append(str(tmp_path / f"{name}.png"))
        _image(h, w).save(paths[-1])
    prompts = [{"prompt": "what is in <start_of_image> here", "images": paths[:1]},
               {"prompt": "a long text before the image crosses a 32-token step: <start_of_image>, then go on",
                "images": paths[1:]}]
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32], page_size=4,
                  num_kv_pages=240, num_decode_steps=1)
    runs = [{"model": str(checkpoint[2]), "mesh": os.path.join(ROOT, "sharding", "configs", m)}
            for m in ("1.yaml", "2.yaml", "2-pp2.yaml")]
    job = {"runs": runs, "prompts": prompts, "max_tokens": 12, "engine": engine}
    results = {os.path.basename(r["mesh"]): r for r in _results(_run_worker(job, 2, tmp_path, "gemma3_images"))}
    for name, r in results.items():
        mc = MeshConfig.from_yaml(os.path.join(ROOT, "sharding", "configs", name))
        planned = memory_plan(plan_source(str(checkpoint[2]), "float32")(mc), mc, parse_bytes("1GB"), dtype="float32")
        assert planned.weights["vision"] > 0 and planned.encoder > 0
        assert r["vision_bytes"] == {str(d): planned.weights["vision"] for d in range(mc.num_devices)}, name
    single = results.pop("1.yaml")
    assert len(single["tokens"]) == 2 and all(len(t) == 12 for t in single["tokens"])
    for name, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (name, json.dumps(r)[:500])
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4)


def test_images_with_int8_weights_at_load_equal_transformers_on_their_values(checkpoint, processor, tmp_path):
    """`weights_quantization="int8"` keeps the language model's projections int8 and serves images with the
    tower as read: greedy tokens and logprobs equal transformers' causal run on the twin (the projections
    replaced by the values their int8 decodes to, tests/quant_twins.py) within 1e-3; `infire-jax plan`
    counts the tower and the image pool as for float weights."""
    import copy

    from infire_jax.memplan.plan import memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from quant_twins import assert_greedy, placed_and_greedy, quantize_twin
    from sharding.mesh import CONFIG_DIR, MeshConfig

    mm, lm, path = checkpoint
    twin_mm, twin_lm = copy.deepcopy(mm), copy.deepcopy(lm)
    quantize_twin(twin_lm, "int8", lambda _: TINY["head_dim"])
    twin_mm.model.language_model.load_state_dict(twin_lm.model.state_dict())
    text = "x" * 25 + "<start_of_image>and<start_of_image>?"
    images = [_image(56, 112), _image(90, 30)]
    theirs = processor(text=text, images=images, return_tensors="np")
    tokens, lps = _hf_greedy(twin_mm, twin_lm, theirs["input_ids"][0].tolist(),
                             theirs["pixel_values"].astype(np.float32), 12)

    placed, out = placed_and_greedy(dict(ENGINE, model=str(path), token_buckets=(32,), weights_quantization="int8",
                                         limit_mm_per_prompt={"image": 2}),
                                    {"prompt": text, "multi_modal_data": {"image": images}}, 12)
    assert {"layers.wqkv.int8", "layers.w_down.int8"} <= placed and "layers.wqkv" not in placed
    assert_greedy(out, tokens, lps, 1e-3)

    mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "1.yaml"))
    plain, int8 = (memory_plan(plan_source(str(path), "float32", q)(mc), mc, parse_bytes("1GB"), dtype="float32")
                   for q in (None, "int8"))
    assert int8.weights["vision"] == plain.weights["vision"] > 0 and int8.encoder == plain.encoder > 0
