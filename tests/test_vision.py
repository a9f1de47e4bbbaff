"""Llama 4's vision tower (infire_jax/vision/): the encoder against transformers' Llama4VisionModel and
projector on random weights of a small vision config; the tiling and the prompt placeholders against
the HF processor's own pure-Python parts (its module imports torchvision, which does not load beside
the CPU torch here, so those functions are read from its source); pixel values against torch's own
bfloat16 arithmetic and a float64 computation of the same steps."""

from __future__ import annotations

import ast
import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from infire_jax.runner.compile_guard import compile_count
from infire_jax.vision import preprocess, prompt
from infire_jax.vision.config import vision_config
from infire_jax.vision.encoder import TILE_BUCKETS, VisionTower, encode, encode_tiles, weights_from_hf
from llama4_models import SPECIAL

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(5)


@functools.cache
def hf_processor_functions() -> dict:
    """get_factors, get_max_res_without_distortion, find_supported_resolutions and get_best_fit from
    transformers' image_processing_llama4.py, executed from its source with torch."""
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.llama4.image_processing_llama4")
    tree = ast.parse(open(spec.origin).read())
    wanted = {"get_factors", "get_max_res_without_distortion", "find_supported_resolutions", "get_best_fit"}
    module = ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    scope = {"math": math, "torch": torch, "defaultdict": collections.defaultdict, "lru_cache": functools.lru_cache,
             "SizeDict": object}
    exec(compile(module, spec.origin, "exec"), scope)
    return {k: scope[k] for k in wanted}


class _Size:
    def __init__(self, side):
        self.height = self.width = side


@pytest.mark.parametrize("size", [(100, 100), (336, 672), (1000, 700), (200, 3000), (4000, 4000), (500, 336),
                                  (337, 337), (50, 1200)])
def test_tile_grid_is_the_processors(size):
    hf = hf_processor_functions()
    hf_canvases = hf["find_supported_resolutions"].__wrapped__(16, _Size(336))
    ours = preprocess.supported_resolutions(16, 336)
    assert ours == [tuple(c) for c in hf_canvases]
    canvas = preprocess.best_fit(size, ours)
    assert canvas == tuple(int(v) for v in hf["get_best_fit"](size, torch.tensor(hf_canvases)))
    limited = tuple(min(max(s, 336), c) for s, c in zip(size, canvas))
    assert preprocess.size_without_distortion(size, limited) == hf["get_max_res_without_distortion"](size, limited)


def test_normalization_is_torchs_bfloat16_arithmetic_and_close_to_float64():
    rgb = RNG.integers(0, 256, (7, 9, 3), dtype=np.uint8)
    ours = preprocess.normalize(rgb)
    t = torch.from_numpy(np.moveaxis(rgb, -1, 0).copy()).to(torch.bfloat16) * (1 / 255)
    t = (t - 0.5) / 0.5  # torchvision's normalize: sub, then div, in the tensor's dtype
    np.testing.assert_array_equal(ours, t.float().numpy())
    exact = (np.moveaxis(rgb, -1, 0).astype(np.float64) / 255 - 0.5) / 0.5
    assert np.max(np.abs(ours - exact)) <= 2 * 2.0 ** -8


def test_a_two_tile_image_needs_no_resampling_and_gets_a_thumbnail():
    rgb = RNG.integers(0, 256, (336, 672, 3), dtype=np.uint8)
    out = preprocess.tiles(Image.fromarray(rgb))
    assert out.grid == (1, 2) and out.pixels.shape == (3, 3, 336, 336)
    np.testing.assert_array_equal(out.pixels[0], preprocess.normalize(rgb[:, :336]))
    np.testing.assert_array_equal(out.pixels[1], preprocess.normalize(rgb[:, 336:]))
    thumb = np.asarray(Image.fromarray(rgb).resize((336, 336), Image.BILINEAR))
    np.testing.assert_array_equal(out.pixels[2], preprocess.normalize(thumb))


def test_a_tall_image_is_resized_padded_black_and_cut_row_by_row():
    rgb = RNG.integers(0, 256, (1000, 700, 3), dtype=np.uint8)
    out = preprocess.tiles(Image.fromarray(rgb))
    canvas = preprocess.best_fit((1000, 700), preprocess.supported_resolutions(16, 336))
    rows, cols = canvas[0] // 336, canvas[1] // 336
    assert out.grid == (rows, cols) and out.pixels.shape == (rows * cols + 1, 3, 336, 336)
    # never upscaled past a tile's side: a canvas larger than the image keeps its size
    h, w = preprocess.size_without_distortion((1000, 700), (min(1000, canvas[0]), min(700, canvas[1])))
    resized = rgb if (h, w) == (1000, 700) else np.asarray(Image.fromarray(rgb).resize((w, h), Image.BILINEAR))
    whole = np.full((3, *canvas), -1.0, np.float32)  # black pads to (0 - 0.5) / 0.5
    whole[:, :h, :w] = preprocess.normalize(resized)
    for r in range(rows):
        for c in range(cols):
            np.testing.assert_array_equal(out.pixels[r * cols + c], whole[:, r * 336:(r + 1) * 336, c * 336:(c + 1) * 336])


def test_a_single_tile_image_has_no_thumbnail():
    out = preprocess.tiles(Image.fromarray(RNG.integers(0, 256, (120, 90, 3), dtype=np.uint8)))
    assert out.grid == (1, 1) and out.pixels.shape == (1, 3, 336, 336)


def test_undecodable_images_are_named():
    with pytest.raises(preprocess.ImageError, match="cannot decode"):
        preprocess.decode(b"not an image")


@pytest.mark.parametrize("grid", [(1, 1), (1, 2), (2, 3), (4, 4)])
def test_placeholder_is_the_processors(grid):
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    want = Llama4Processor._prompt_split_image(None, grid, 144)
    assert "".join(prompt.image_tokens(grid, 144)) == want
    assert prompt.expand(f"a {prompt.IMAGE} b {prompt.IMAGE}", [grid, (1, 1)], 144) == \
        f"a {want} b {Llama4Processor._prompt_split_image(None, (1, 1), 144)}"
    with pytest.raises(ValueError, match="2 <|image|> markers for 1 images"):
        prompt.expand(f"{prompt.IMAGE}{prompt.IMAGE}", [grid], 144)


def _tiny_hf():
    """A random Llama 4 vision tower and projector of a small config (56-pixel tiles of 14-pixel
    patches: 16 patches, 4 tokens a tile), every parameter drawn, norms and biases included."""
    from transformers.models.llama4.configuration_llama4 import Llama4Config
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    config = Llama4Config(
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                           image_size=56, patch_size=14, vision_output_dim=96, projector_input_dim=96,
                           projector_output_dim=96, pixel_shuffle_ratio=0.5),
        text_config=dict(hidden_size=48, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300))
    torch.manual_seed(0)
    tower, projector = Llama4VisionModel(config.vision_config).eval(), Llama4MultiModalProjector(config).eval()
    with torch.no_grad():
        for p in list(tower.parameters()) + list(projector.parameters()):
            p.copy_(torch.randn_like(p) * 0.2)
    tensors = {f"vision_model.{k}": v.numpy() for k, v in tower.state_dict().items()}
    tensors |= {f"multi_modal_projector.{k}": v.numpy() for k, v in projector.state_dict().items()}
    return config, tower, projector, tensors


def test_encoder_equals_hf_on_several_tiles():
    config, tower, projector, tensors = _tiny_hf()
    cfg = vision_config(config.to_dict())
    assert (cfg.tokens_per_tile, cfg.text_hidden_size, cfg.image_token_id) == (4, 48, config.image_token_index)
    weights = weights_from_hf(cfg, tensors)
    pixels = RNG.standard_normal((3, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        features = tower(torch.from_numpy(pixels)).last_hidden_state
        want = projector(features.reshape(-1, features.shape[-1])).reshape(3, -1, 48).numpy()
    got = np.asarray(jax.jit(lambda w, p: encode_tiles(cfg, w, p))(weights, jnp.asarray(pixels)))
    assert got.shape == (3, cfg.tokens_per_tile, 48)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # in its tile bucket (padded with blank tiles), the same
    np.testing.assert_allclose(np.asarray(encode(cfg, weights, pixels)), got, rtol=1e-5, atol=1e-5 * np.abs(got).max())
    assert TILE_BUCKETS[-1] == 17  # a full 4 x 4 grid and its thumbnail


def test_the_tower_module_lays_out_the_weights_as_the_checkpoint():
    config, _, _, tensors = _tiny_hf()
    cfg = vision_config(config.to_dict())
    from flax import nnx

    abstract = nnx.eval_shape(lambda: VisionTower(cfg))
    shapes = jax.tree.map(lambda a: a.shape, abstract.weights())
    assert shapes == jax.tree.map(lambda a: a.shape, weights_from_hf(cfg, tensors))


def test_dummy_llama4_has_the_published_tower_and_image_tokens():
    """`dummy:llama-4-scout` serves images as a checkpoint would: the published tower's config, random
    weights in the layout a checkpoint's load to (drawn here for the small config), and a tokenizer
    whose image placeholder strings are single tokens at the config's ids."""
    from infire_jax.loaders.dummy import dummy_hf_config, load_dummy
    from infire_jax.loaders.vision import has_vision
    from infire_jax.vision.encoder import random_weights

    assert has_vision("dummy:llama-4-scout,layers=2") and not has_vision("dummy:llama-3.1-8b")
    hf = dummy_hf_config("llama-4-scout")
    cfg = vision_config(hf)
    assert (cfg.hidden_size, cfg.num_layers, cfg.tokens_per_tile, cfg.text_hidden_size) == (1408, 34, 144, 5120)
    tokenizer = load_dummy("llama-4-scout,layers=1").tokenizer
    image = prompt.image_tokens((1, 2), cfg.tokens_per_tile)
    ids = tokenizer.encode("hi " + "".join(image) + " bye")
    assert len(ids) == len(tokenizer.encode("hi ")) + len(image) + len(tokenizer.encode(" bye"))
    assert ids.count(cfg.image_token_id) == 3 * 144 and ids.count(hf["boi_token_index"]) == 1
    assert ids.count(hf["eoi_token_index"]) == 1
    config, _, _, tensors = _tiny_hf()
    tiny = vision_config(config.to_dict())
    drawn, loaded = random_weights(tiny, jnp.float32), weights_from_hf(tiny, tensors)
    assert jax.tree.map(jnp.shape, drawn) == jax.tree.map(jnp.shape, loaded)
    assert float(jnp.std(drawn["layers"]["wq"])) == pytest.approx(0.02, rel=0.05)
    assert bool(jnp.all(drawn["pre_norm"]["scale"] == 1)) and bool(jnp.all(drawn["layers"]["b1"] == 0))


def test_vision_config_refuses_what_it_does_not_implement():
    from infire_jax.errors import UnsupportedModelError

    config = _tiny_hf()[0].to_dict()
    config["vision_config"]["hidden_act"] = "silu"
    with pytest.raises(UnsupportedModelError, match="gelu"):
        vision_config(config)
    config["vision_config"]["hidden_act"] = "gelu"
    config["vision_config"]["mystery"] = 1
    with pytest.raises(UnsupportedModelError, match="mystery"):
        vision_config(config)
    assert ml_dtypes.bfloat16  # the processor's dtype, used by preprocess.normalize


def test_a_saved_checkpoints_tower_loads_and_encodes_as_hf(tmp_path):
    """The tiny multimodal Llama 4 of tests/llama4_models.py's text config with a two-layer tower of
    56-pixel tiles, saved as transformers saves it: its tower read by name from the safetensors files
    (nothing of the text model) encodes tiles as the HF model's own image features and projector do."""
    from llama4_models import TEXT_CONFIGS, save
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from infire_jax.loaders.vision import has_vision, load_vision_tower

    torch.manual_seed(1)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=TEXT_CONFIGS["multimodal"],
                                                        vision_config=vision)).eval()
    path = save(model, tmp_path / "mm")
    assert has_vision(path)
    cfg, tensors = load_vision_tower(path)
    assert all(n.startswith(("vision_model.", "multi_modal_projector.")) for n in tensors)
    pixels = RNG.standard_normal((2, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.from_numpy(pixels), return_dict=True).last_hidden_state
        want = model.multi_modal_projector(features.reshape(-1, features.shape[-1])).numpy()
    got = np.asarray(encode(cfg, weights_from_hf(cfg, tensors), pixels)).reshape(-1, cfg.text_hidden_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not has_vision(str(tmp_path))  # no config.json there


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """tests/llama4_models.py's `image_checkpoint`: (the HF model, its directory)."""
    from llama4_models import image_checkpoint

    return image_checkpoint(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def mm_llm(multimodal):
    from infire_jax import LLM

    return LLM(model=multimodal[1], dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32),
               max_model_len=128, num_kv_pages=40, limit_mm_per_prompt={"image": 2})


def _hf_greedy_with_images(model, ids: list[int], pixels: np.ndarray, num_tokens: int):
    """HF's greedy tokens and their float64 log-probabilities: its tower's and projector's outputs put
    in place of the <|patch|> embeddings, as the wrapper's forward does (which fails in this
    transformers on a text model without `image_outputs`), then its text model's generate."""
    lm = model.language_model
    lm.generation_config.eos_token_id = None
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.from_numpy(pixels), return_dict=True).last_hidden_state
        projected = model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
        ids_t = torch.tensor([ids])
        embeds = lm.get_input_embeddings()(ids_t)
        embeds = embeds.masked_scatter((ids_t == SPECIAL[prompt.PATCH])[..., None].expand_as(embeds), projected)
        out = lm.generate(inputs_embeds=embeds, max_new_tokens=num_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    want = out.sequences[0].tolist()
    return want, [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, want)]


def _placeholder_ids(grid, per_tile: int) -> list[int]:
    return [SPECIAL[t] for t in prompt.image_tokens(grid, per_tile)]


def test_generate_with_images_equals_hf(multimodal, mm_llm):
    """Greedy tokens and logprobs with images equal HF's within 1e-3: one tile, two tiles with the
    thumbnail, and two images in one prompt, on the same pixel values; 32-token steps cut the long
    prompt's image span across two prefill chunks. Nothing stays in the image pool afterwards."""
    from infire_jax import SamplingParams

    model, llm = multimodal[0], mm_llm
    images = llm.engine.images
    assert images is not None and images.cfg.tokens_per_tile == 4
    wide = Image.fromarray(RNG.integers(0, 256, (56, 112, 3), dtype=np.uint8))  # 1 x 2 tiles and the thumbnail
    small = Image.fromarray(RNG.integers(0, 256, (40, 40, 3), dtype=np.uint8))  # one tile
    cases = [([small], [5, 77]), ([wide], list(range(60, 84))), ([wide, small], [9, 8])]
    prompts, want = [], []
    for imgs, text in cases:
        tiles = [preprocess.tiles(im, 56) for im in imgs]
        ids = list(text)
        for t in tiles:
            ids += _placeholder_ids(t.grid, 4) + [13]
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}})
        want.append(_hf_greedy_with_images(model, ids, np.concatenate([t.pixels for t in tiles]), 16))
    free, compiles = images.pool.free_rows, compile_count()
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1))
    assert compile_count() == compiles  # the encoder's tile buckets were compiled with the engine
    for out, (tokens, lps) in zip(outs, want):
        assert out.outputs[0].token_ids == tokens
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)], lps, atol=1e-3, rtol=0)
    assert images.pool.free_rows == free == images.pool.num_rows
    # the image matters: the same prompt with another image answers otherwise
    other = Image.fromarray(RNG.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    swapped = llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"],
                             "multi_modal_data": {"image": other}}], SamplingParams(max_tokens=16, temperature=0,
                                                                                      ignore_eos=True))
    assert swapped[0].outputs[0].token_ids != outs[0].outputs[0].token_ids


def test_bad_image_requests_are_refused_and_hold_nothing(mm_llm):
    from infire_jax import SamplingParams
    from infire_jax.errors import InvalidRequestError

    llm = mm_llm
    pool = llm.engine.images.pool
    small = Image.fromarray(RNG.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    ids = [5] + _placeholder_ids((1, 1), 4)
    params = SamplingParams(max_tokens=2)
    bad = [({"prompt_token_ids": ids, "multi_modal_data": {"image": [small] * 3}}, "at most 2"),
           ({"prompt_token_ids": ids[:-2], "multi_modal_data": {"image": small}}, "3 image patch tokens, its images 4"),
           ({"prompt_token_ids": ids, "multi_modal_data": {"image": b"not an image"}}, "cannot decode"),
           ({"prompt_token_ids": ids, "multi_modal_data": {"video": small}}, "takes {'image'"),
           ({"prompt": "no marker", "multi_modal_data": {"image": small}}, "0 <|image|> markers for 1 images")]
    for prompt_dict, message in bad:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            llm.generate(prompt_dict, params)
        assert pool.free_rows == pool.num_rows and not llm.engine.has_unfinished()
    # a prompt past max_model_len is refused after its image's rows were reserved: they come back
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 130 + ids, "multi_modal_data": {"image": small}}, params)
    assert pool.free_rows == pool.num_rows


def test_same_image_hits_the_prefix_cache_and_another_does_not(mm_llm):
    """The pages of a prompt with an image are keyed by its pixels: the same image again reuses them
    (cached tokens) and is not encoded again (its tokens are all in the hit), another image with the
    same token ids reuses none."""
    from infire_jax import SamplingParams

    ids = list(range(20, 40)) + _placeholder_ids((1, 1), 4) + [13] * 16  # 43 tokens: the image in two full pages
    image = Image.fromarray(RNG.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    other = Image.fromarray(RNG.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    params = SamplingParams(max_tokens=2, temperature=0)
    run = lambda im: mm_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": im}}, params)[0]  # noqa: E731
    encoded = lambda: mm_llm.engine.stats.images_encoded  # noqa: E731
    before = encoded()
    assert run(image).num_cached_tokens == 0 and encoded() == before + 1
    assert run(image).num_cached_tokens == 32 and encoded() == before + 1
    assert run(other).num_cached_tokens == 0 and encoded() == before + 2


def test_chat_with_a_data_url_equals_offline(mm_llm):
    """Through the server: a chat message with a base64 PNG data URL, and the Responses API's
    input_image, answer as the offline engine does on the same text and image; an undecodable image,
    an http URL that is not an image and a file: URL (none allowed) are 400s naming the part, and
    leave the image pool empty."""
    import base64
    import io
    import json
    import urllib.error
    import urllib.request

    from server_utils import AppThread

    from infire_jax import SamplingParams
    from server.app import build_app

    image = Image.fromarray(RNG.integers(0, 256, (56, 112, 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    # Offline first: while the server runs, its engine thread owns the engine (its last request's final
    # step may still run after the answer is out; two threads stepping one engine crash).
    assert mm_llm.reset_prefix_cache()
    want = mm_llm.generate({"prompt": "look:\n<|image|>", "multi_modal_data": {"image": image}},
                           SamplingParams(max_tokens=12, temperature=0))[0]
    assert want.num_cached_tokens == 0
    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(mm_llm.engine)))

        def post(path, body):
            # a tenant of its own: no pages from the prefix cache, which computes the same logits in
            # another order (random weights leave near-ties; CI saw one flip)
            req = urllib.request.Request(servers.urls[0] + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json", "x-tenant-id": path})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.load(r)
            except urllib.error.HTTPError as e:
                return e.code, json.load(e)

        def chat(parts):
            return post("/v1/chat/completions", {"model": mm_llm.engine.model_name, "max_tokens": 12,
                                                 "temperature": 0, "messages": [{"role": "user", "content": parts}]})

        def respond(items):
            return post("/v1/responses", {"model": mm_llm.engine.model_name, "max_output_tokens": 12,
                                          "temperature": 0, "input": items})

        status, got = chat([{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": url}}])
        assert status == 200, got
        assert got["choices"][0]["message"]["content"] == want.outputs[0].text
        assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        # the Responses API's input_image, as chat's image_url
        status, got = respond([{"role": "user", "content": [{"type": "input_text", "text": "look:"},
                                                            {"type": "input_image", "image_url": url}]}])
        assert status == 200, got
        assert got["output"][-1]["content"][0]["text"] == want.outputs[0].text
        assert got["usage"]["input_tokens"] == len(want.prompt_token_ids)
        for items, param in [([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
                              "input[0].content[0].file_id"),
                             ([{"type": "function_call_output", "call_id": "c",
                                "output": [{"type": "input_image", "image_url": url}]}], "input[0].output[0]")]:
            status, err = respond(items)
            assert status == 400 and err["error"]["param"] == param, err
        pool = mm_llm.engine.images.pool
        for part, message in [({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                               "cannot decode"),
                              ({"type": "image_url", "image_url": {"url": servers.urls[0] + "/health"}},
                               "not an image"),
                              ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                               "--allowed-local-media-path"),
                              ({"type": "input_image", "image_url": url}, "not taken here")]:
            status, err = chat([{"type": "text", "text": "x"}, part])
            assert status == 400 and message in err["error"]["message"], err
            assert err["error"]["param"].startswith("messages[0].content[1]"), err
        assert pool.free_rows == pool.num_rows and not mm_llm.engine.has_unfinished()
    finally:
        servers.close()


def test_latency_bench_times_requests_with_images(mm_llm):
    """`bench latency --images-per-request`: each prompt's text is followed by its random images'
    placeholders (a 100-pixel square: a 2 x 2 grid and its thumbnail, 5 tiles of 4 tokens), their
    encoding counted in the time to the first token, and their pool rows freed afterwards."""
    from infire_jax.bench import latency
    from infire_jax.bench.roofline import DevicePeaks

    peaks = DevicePeaks("cpu", "cpu", 1e10, 1e11, "float32", 1 << 20, 256)
    r = latency.measure(mm_llm.engine, peaks, batch=2, input_len=8, output_len=16, iters=1, warmup=0, seed=0,
                        images_per_request=2, image_size=100)
    assert (r["images_per_request"], r["image_size"], r["num_requests"]) == (2, 100, 2)
    assert 0 < r["mean_add_ms"] < r["mean_ttft_ms"]
    images, ids = latency.request_images(mm_llm.engine, 2, 100, 0)
    assert ids.count(mm_llm.engine.images.cfg.image_token_id) == 2 * 5 * 4 and len(images) == 2
    pool = mm_llm.engine.images.pool
    assert pool.free_rows == pool.num_rows and not mm_llm.engine.has_unfinished()


def test_more_images_than_the_pool_holds_wait_for_rows(mm_llm):
    """Twelve prompts of a 17-tile image each, where the pool holds eight such images: offline and
    through the server (twelve chat requests at once) the last ones wait for rows and answer as the
    prompts run in two halves that fit; nothing is refused and the pool ends empty."""
    import concurrent.futures
    import io
    import base64
    import json
    import urllib.request

    from server_utils import AppThread

    from infire_jax import SamplingParams
    from server.app import build_app

    pool = mm_llm.engine.images.pool
    images = [Image.fromarray(RNG.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(12)]
    rows = mm_llm.engine.images.tiles(images[0]).pixels.shape[0] * mm_llm.engine.images.cfg.tokens_per_tile
    assert rows == 17 * 4 and 8 * rows <= pool.num_rows < 12 * rows
    prompts = [{"prompt": "look:\n<|image|>", "multi_modal_data": {"image": im}} for im in images]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert mm_llm.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in mm_llm.generate(prompts, params)]
    halves = []
    for half in (prompts[:6], prompts[6:]):
        assert mm_llm.reset_prefix_cache()
        halves += [o.outputs[0] for o in mm_llm.generate(half, params)]
    assert together == [o.token_ids for o in halves] and pool.free_rows == pool.num_rows

    def data_url(im):
        png = io.BytesIO()
        im.save(png, format="PNG")
        return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()

    def chat(im):
        body = {"model": mm_llm.engine.model_name, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "look:"},
                                                          {"type": "image_url", "image_url": {"url": data_url(im)}}]}]}
        req = urllib.request.Request(servers.urls[0] + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "x-tenant-id": "queue"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(mm_llm.engine)))
        with concurrent.futures.ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(chat, images))
    finally:
        servers.close()
    assert answers == [o.text for o in halves]
    assert pool.free_rows == pool.num_rows and not mm_llm.engine.has_unfinished()


def test_pool_rows_are_reserved_first_fit_and_merged_back():
    """A full pool refuses with a message saying so; freed rows merge with their neighbours; a request's
    images are checked for room, first fit, before any is encoded (nothing reserved by the check)."""
    from infire_jax.errors import InvalidRequestError
    from infire_jax.runner.image_pool import ImagePool, ImagePoolFull

    config, _, _, tensors = _tiny_hf()
    cfg = vision_config(config.to_dict())
    pool = ImagePool(cfg, weights_from_hf(cfg, tensors), 40)
    a, b = pool.reserve(16), pool.reserve(16)
    assert (a, b) == (0, 16) and pool.free_rows == 8
    with pytest.raises(ImagePoolFull, match="fill the device's image pool"):
        pool.reserve(16)
    tiles = [np.zeros((n, 3, 56, 56), np.float32) for n in (1, 1, 3)]  # 4, 4 and 16 rows (a 4-tile bucket)
    pool.check_room(tiles[:2])
    with pytest.raises(ImagePoolFull):
        pool.check_room(tiles)
    with pytest.raises(InvalidRequestError, match="which has 40") as e:
        pool.check_room([np.zeros((17, 3, 56, 56), np.float32)])
    assert not isinstance(e.value, ImagePoolFull) and pool.free_rows == 8
    pool.release(a, 16)
    assert pool.reserve(8) == 0 and pool.reserve(8) == 8  # first fit, in the freed span
    for start, n in ((0, 8), (b, 16), (8, 8)):
        pool.release(start, n)
    assert pool.free_rows == 40 and pool.reserve(40) == 0  # one span again


def test_offline_chat_takes_image_parts(mm_llm):
    """`LLM.chat` with an image part (a PIL image, or a data URL) answers as `generate` on the text with
    the image's marker; a text-only list of parts renders as before; an unknown part is refused."""
    import base64
    import io

    from infire_jax import SamplingParams
    from infire_jax.errors import InvalidRequestError

    image = Image.fromarray(RNG.integers(0, 256, (56, 112, 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    params = SamplingParams(max_tokens=12, temperature=0)
    want = mm_llm.generate({"prompt": "look:\n<|image|>", "multi_modal_data": {"image": image}}, params)[0]
    for part in ({"type": "image", "image": image}, {"type": "image_url", "image_url": {"url": url}}):
        # each computed afresh: pages from the prefix cache give the same logits in another order, which
        # random weights' near-ties can flip (CI saw it once in the server's test above)
        assert mm_llm.reset_prefix_cache()
        got = mm_llm.chat([{"role": "user", "content": [{"type": "text", "text": "look:"}, part]}], params)[0]
        assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.prompt_token_ids == want.prompt_token_ids
    with pytest.raises(InvalidRequestError, match="content part 1"):
        mm_llm.chat([{"role": "user", "content": [{"type": "image", "image": image}, {"type": "video"}]}], params)
    pool = mm_llm.engine.images.pool
    assert pool.free_rows == pool.num_rows


def test_images_with_fp8_weights_kept_equal_hf_on_the_values_they_decode_to(multimodal, tmp_path):
    """Llama 4 Maverick's FP8 form (compressed-tensors, a scale a row, the text attention left float by
    `ignore`; here the routed experts, fused, and so the dense MLPs left float too: test_kept_8bit.py has
    them all), with the tower's and the projector's linears in fp8: kept (`weights_quantization=
    "checkpoint"`), the shared experts are held as fp8 parts, the tower is read dequantized, and greedy tokens with images (two tiles and the thumbnail) equal HF's on the twin
    checkpoint of the values the fp8 decodes to, logprobs within 1e-3."""
    from transformers import Llama4ForConditionalGeneration

    from quant_twins import LAYER_LINEAR, assert_greedy, placed_and_greedy, write_8bit

    tower = r"vision_model\..*\.(q_proj|k_proj|v_proj|o_proj|fc1|fc2)\.weight|multi_modal_projector\.linear_1\.weight"
    quantized, twin = str(tmp_path / "fp8"), str(tmp_path / "twin")
    write_8bit(multimodal[1], quantized, twin, "fp8-channel", ignore=r"language_model\..*(self_attn|\d\.feed_forward\.[a-z]+_proj)",
               linear=re.compile(f"{LAYER_LINEAR.pattern}|{tower}"))
    ref = Llama4ForConditionalGeneration.from_pretrained(twin, torch_dtype=torch.float32).eval()
    wide = Image.fromarray(RNG.integers(0, 256, (56, 112, 3), dtype=np.uint8))
    tiles = preprocess.tiles(wide, 56)
    ids = [7, 41] + _placeholder_ids(tiles.grid, 4) + [13]
    tokens, lps = _hf_greedy_with_images(ref, ids, tiles.pixels, 12)

    engine = dict(model=quantized, weights_quantization="checkpoint", dtype="float32", max_num_seqs=2,
                  max_num_batched_tokens=32, token_buckets=(32,), max_model_len=128, num_kv_pages=40)
    placed, out = placed_and_greedy(engine, {"prompt_token_ids": ids, "multi_modal_data": {"image": wide}}, 12)
    assert {"moe_layers.w_shared_gate_up.fp8", "moe_layers.w_shared_down.fp8"} <= placed
    assert "moe_layers.w_shared_gate_up" not in placed and "dense_layers.w_gate_up" in placed
    assert_greedy(out, tokens, lps, 1e-3)
