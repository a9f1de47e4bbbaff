"""Images on a mesh: the tiny multimodal Llama 4 of test_vision.py (llama4_models.image_checkpoint)
on 2 virtual CPU devices, tensor parallel (tp 2) and on a pipeline of 2 stages, gives one device's
greedy tokens and logprobs for prompts with images; each device holds the tower and the image pool
whole, the bytes `infire-jax plan` counts for it. Across processes images are refused at build."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    from llama4_models import image_checkpoint

    return image_checkpoint(tmp_path_factory.mktemp("vision_mesh"))


def test_images_on_tp_and_pp_meshes_match_one_device(multimodal, tmp_path):
    from test_sharding import ROOT, _results, _run_worker

    from infire_jax.memplan.plan import memory_plan, parse_bytes
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import MeshConfig

    def mesh(name):
        return os.path.join(ROOT, "sharding", "configs", name)

    paths = []
    for name, shape in (("wide", (56, 112, 3)), ("small", (40, 40, 3))):  # 1 x 2 tiles and the thumbnail; one tile
        paths.append(str(tmp_path / f"{name}.png"))
        Image.fromarray(RNG.integers(0, 256, shape, dtype=np.uint8)).save(paths[-1])
    prompts = [{"prompt": "what is in <|image|> here", "images": paths[:1]},
               {"prompt": "a long text before the image crosses a 32-token step: <|image|>, then go on",
                "images": paths[1:]},
               "a prompt of text alone"]
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32], num_kv_pages=40,
                  num_decode_steps=1)
    runs = [{"model": multimodal[1], "mesh": mesh(m)} for m in ("1.yaml", "2.yaml", "2-pp2.yaml")]
    job = {"runs": runs, "prompts": prompts, "max_tokens": 12, "engine": engine}
    results = {os.path.basename(r["mesh"]): r for r in _results(_run_worker(job, 2, tmp_path, "vision"))}
    for name, r in results.items():  # the tower and the pool whole on each device, as the plan counts them
        mc = MeshConfig.from_yaml(mesh(name))
        planned = memory_plan(plan_source(multimodal[1], "float32")(mc), mc, parse_bytes("1GB"), dtype="float32")
        assert r["vision_bytes"] == {str(d): planned.weights["vision"] for d in range(mc.num_devices)}, name
    single = results.pop("1.yaml")
    assert len(single["tokens"]) == 3 and all(len(t) == 12 for t in single["tokens"])
    for name, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (name, json.dumps(r)[:500])
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4)


def test_images_across_processes_are_refused_at_build(multimodal, monkeypatch):
    from infire_jax import EngineConfig
    from infire_jax.engine.setup import resolve_settings
    from infire_jax.errors import ConfigError
    from infire_jax.runner import multihost

    monkeypatch.setattr(multihost, "is_multiprocess", lambda: True)
    with pytest.raises(ConfigError, match="images are not served on a mesh over several processes"):
        resolve_settings(EngineConfig(model=multimodal[1], max_model_len=128, num_kv_pages=40), None)
    text = resolve_settings(EngineConfig(model=multimodal[1], max_model_len=128, num_kv_pages=40,
                                         limit_mm_per_prompt={"image": 0}), None)
    assert text.vision is None and text.runner_config.image_pool is None


def test_a_pool_sized_from_device_memory_leaves_the_tower_room(multimodal, monkeypatch):
    """Where the pool fills the device (a GPU: here its memory figure is given), the vision tower, placed
    after the pool, counts with the weights (as the placed tower's bytes) and its largest call's
    temporaries with the step's; served text alone, neither."""
    import jax

    from infire_jax import Engine, EngineConfig
    from infire_jax.runner import kv_pool

    monkeypatch.setattr(kv_pool, "device_memory", lambda: (64 << 20, 64 << 20, 0))
    sizings, towers = [], []
    for images in (0, 1):
        engine = Engine(EngineConfig(model=multimodal[1], dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
                                     token_buckets=(32,), max_model_len=128, num_decode_steps=1,
                                     limit_mm_per_prompt={"image": images}))
        sizings.append(engine.pool_sizing)
        tower = [] if engine.images is None else jax.tree.leaves(engine.images.pool.weights)
        towers.append(sum(a.nbytes for a in tower))
        engine.close()
    text, vision = sizings
    assert text.source == vision.source == "device memory" and towers[0] == 0 < towers[1]
    assert vision.weight_bytes == text.weight_bytes + towers[1]
    assert vision.activation_bytes > text.activation_bytes  # the encoder's 17 tiles beside the step
    assert vision.num_pages < text.num_pages
