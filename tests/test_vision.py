"""Llama 4's vision tower (infire_jax/vision/): the encoder against transformers' Llama4VisionModel and
projector on random weights of a small vision config; the tiling and the prompt placeholders against
the HF processor's own pure-Python parts (its module imports torchvision, which does not load beside
the CPU torch here, so those functions are read from its source); pixel values against torch's own
bfloat16 arithmetic and a float64 computation of the same steps."""

from __future__ import annotations

import ast
import collections
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from infire_jax.vision import preprocess, prompt
from infire_jax.vision.config import vision_config
from infire_jax.vision.encoder import TILE_BUCKETS, VisionTower, encode, encode_tiles, weights_from_hf

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
