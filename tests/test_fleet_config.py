"""The fleet YAML: good files load with the right values, each bad one raises ValueError naming the problem.

Fast: no process starts here (tests/test_fleet.py runs real fleets).
"""

from __future__ import annotations

import argparse
import os
import textwrap

import pytest

from router.fleet import add_fleet_args, run_fleet
from router.fleet_config import FleetConfig, RouterSpec, WorkerSpec, load_fleet_config, parse_fleet_config

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "router", "configs")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_full_config_loads(tmp_path):
    path = _write(tmp_path, """
        model: /models/smol.gguf
        worker_args: ["--dtype", "float32", "--max-num-seqs", 32]
        router:
          host: 0.0.0.0
          port: 9000
          args: ["--policy", "round_robin", "--no-affinity"]
        workers:
          - name: p0
            role: prefill
            port: 8101
            cpus: [0]
            gpus: [0, 1]
            env: {XLA_PYTHON_CLIENT_MEM_FRACTION: 0.45}
            args: ["--max-num-batched-tokens", "512"]
          - name: d0
            role: decode
            model: /models/other.gguf
            cpus: 0
    """)
    cfg = load_fleet_config(path)
    assert cfg == FleetConfig(
        workers=(WorkerSpec(name="p0", role="prefill", port=8101, cpus=(0,), gpus=(0, 1),
                            env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45"),), args=("--max-num-batched-tokens", "512")),
                 WorkerSpec(name="d0", role="decode", model="/models/other.gguf", cpus=(0,))),
        router=RouterSpec(host="0.0.0.0", port=9000, args=("--policy", "round_robin", "--no-affinity")),
        model="/models/smol.gguf", worker_args=("--dtype", "float32", "--max-num-seqs", "32"), source=path)
    assert cfg.disaggregated and cfg.roles() == {"prefill": 1, "decode": 1}
    assert cfg.describe() == "1 prefill + 1 decode; router --policy round_robin --no-affinity"
    assert cfg.worker_command(cfg.workers[0], "py") == [
        "py", "-m", "infire_jax", "serve", "--host", "127.0.0.1", "--port", "8101", "--role", "prefill",
        "--model", "/models/smol.gguf", "--dtype", "float32", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]
    assert cfg.worker_command(cfg.workers[1], "py")[9:12] == ["decode", "--model", "/models/other.gguf"]


def test_minimal_config_defaults():
    cfg = parse_fleet_config({"workers": [{"role": "both"}, {"role": "both"}]})
    assert [w.name for w in cfg.workers] == ["both0", "both1"]
    assert cfg.router == RouterSpec(host="127.0.0.1", port=8000, args=())
    assert cfg.model is None and cfg.worker_args == () and not cfg.disaggregated
    w = cfg.workers[0]
    assert (w.host, w.port, w.cpus, w.gpus, w.args) == ("127.0.0.1", 0, None, None, ())
    assert cfg.worker_command(w, "py") == ["py", "-m", "infire_jax", "serve", "--host", "127.0.0.1", "--port", "0",
                                           "--role", "both"]
    assert cfg.describe() == "2 both; router (default flags)"


def test_mixed_roles_with_prefill_and_decode():
    cfg = parse_fleet_config({"workers": [{"role": "both"}, {"role": "prefill"}, {"role": "decode"}]})
    assert cfg.roles() == {"prefill": 1, "decode": 1, "both": 1}


@pytest.mark.parametrize("name", ["local-disaggregated.yaml", "local-replicas.yaml", "gpu1-disaggregated.yaml",
                                  "gpu1-replicas.yaml"])
def test_shipped_examples_load(name):
    cfg = load_fleet_config(os.path.join(CONFIGS, name))
    roles = ["prefill", "decode"] if "disaggregated" in name else ["both", "both"]
    if name.startswith("local"):
        assert [(w.role, w.cpus) for w in cfg.workers] == list(zip(roles, [(0,), (1,)]))
    else:  # one GPU shared: each worker's allocator takes under half of it
        assert [(w.role, w.gpus, dict(w.env)) for w in cfg.workers] == [
            (r, (0,), {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.47"}) for r in roles]
        assert cfg.model == "dummy:llama-3.1-8b"


GOOD_WORKERS = [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]


@pytest.mark.parametrize("data, expected", [
    ([1, 2], "expected a mapping"),
    ({"workers": GOOD_WORKERS, "modle": "x"}, "modle: unknown key"),
    ({}, "workers: expected a non-empty list"),
    ({"workers": []}, "workers: expected a non-empty list"),
    ({"workers": {"name": "p"}}, "workers: expected a non-empty list"),
    ({"workers": ["both"]}, "workers[0]: expected a mapping"),
    ({"workers": [{"role": "both", "cpu": [0]}]}, "workers[0].cpu: unknown key"),
    ({"workers": [{"role": "both", "env": ["A=1"]}]}, "workers[0].env: expected a mapping"),
    ({"workers": [{"role": "both", "env": {"A": True}}]}, "workers[0].env: expected a mapping"),
    ({"workers": [{"name": "x"}]}, "workers[0].role: expected one of prefill, decode, both, got None"),
    ({"workers": [{"role": "encode"}]}, "workers[0].role: expected one of prefill, decode, both, got 'encode'"),
    ({"workers": [{"role": "prefill"}]}, "need at least one 'decode' worker"),
    ({"workers": [{"role": "decode"}, {"role": "decode"}]}, "need at least one 'prefill' worker"),
    ({"workers": [{"role": "both"}, {"role": "prefill"}]}, "need at least one 'decode' worker"),
    ({"workers": [{"role": "both"}, {"role": "decode"}]}, "need at least one 'prefill' worker"),
    ({"workers": [{"name": "a", "role": "both"}, {"name": "a", "role": "both"}]},
     "workers[1].name: 'a' is also the name of workers[0]"),
    ({"workers": [{"role": "both"}, {"name": "both0", "role": "both"}]}, "workers[1].name: 'both0' is also"),
    ({"workers": [{"name": "a/b", "role": "both"}]}, "workers[0].name: expected letters"),
    ({"workers": [{"name": 7, "role": "both"}]}, "workers[0].name: expected letters"),
    ({"workers": [{"role": "both", "cpus": [os.cpu_count()]}]},
     f"workers[0].cpus[0]: expected a CPU index in 0..{os.cpu_count() - 1}"),
    ({"workers": [{"role": "both", "cpus": [0, -1]}]}, "workers[0].cpus[1]: expected a CPU index"),
    ({"workers": [{"role": "both", "cpus": []}]}, "workers[0].cpus: expected a non-empty list"),
    ({"workers": [{"role": "both", "cpus": "0-3"}]}, "workers[0].cpus: expected a non-empty list"),
    ({"workers": [{"role": "both", "cpus": [True]}]}, "workers[0].cpus[0]"),
    ({"workers": [{"role": "both", "gpus": [-1]}]}, "workers[0].gpus[0]: expected a GPU index >= 0"),
    ({"workers": [{"role": "both", "port": 70000}]}, "workers[0].port: expected a port number in 0..65535"),
    ({"workers": [{"role": "both", "port": -1}]}, "workers[0].port"),
    ({"workers": [{"role": "both", "port": "8001"}]}, "workers[0].port"),
    ({"workers": [{"role": "both", "port": 8001}, {"role": "both", "port": 8001}]},
     "workers[1].port: port 8001 is also workers[0].port"),
    ({"router": {"port": 8001}, "workers": [{"role": "both", "port": 8001}]},
     "workers[0].port: port 8001 is also router.port"),
    ({"router": {"port": 1.5}, "workers": GOOD_WORKERS}, "router.port: expected a port number"),
    ({"router": {"host": ""}, "workers": GOOD_WORKERS}, "router.host: expected a non-empty string"),
    ({"router": {"policy": "x"}, "workers": GOOD_WORKERS}, "router.policy: unknown key"),
    ({"router": ["--policy"], "workers": GOOD_WORKERS}, "router: expected a mapping"),
    ({"router": {"args": "--policy round_robin"}, "workers": GOOD_WORKERS}, "router.args: expected a list"),
    ({"router": {"args": ["--prefill", "http://x"]}, "workers": GOOD_WORKERS},
     "router.args[0]: '--prefill' is set by the fleet itself"),
    ({"router": {"args": ["--port=9"]}, "workers": GOOD_WORKERS}, "router.args[0]: '--port=9' is set by the fleet"),
    ({"worker_args": ["--role", "both"], "workers": GOOD_WORKERS}, "worker_args[0]: '--role' is set by the fleet"),
    ({"worker_args": [None], "workers": GOOD_WORKERS}, "worker_args[0]: expected a string or a number"),
    ({"workers": [{"role": "both", "args": ["--model", "m"]}]}, "workers[0].args[0]: '--model' is set by the fleet"),
    ({"workers": [{"role": "both", "args": [["--x"]]}]}, "workers[0].args[0]: expected a string or a number"),
    ({"model": 3, "workers": GOOD_WORKERS}, "model: expected a non-empty string"),
    ({"workers": [{"role": "both", "model": ""}]}, "workers[0].model: expected a non-empty string"),
])
def test_bad_configs_name_the_problem(data, expected):
    with pytest.raises(ValueError) as e:
        parse_fleet_config(data)
    assert expected in str(e.value)


def test_bad_yaml_and_file_name_in_message(tmp_path):
    with pytest.raises(ValueError, match="not valid YAML"):
        load_fleet_config(_write(tmp_path, "workers: [\n"))
    path = _write(tmp_path, "workers:\n  - role: nope\n")
    with pytest.raises(ValueError) as e:
        load_fleet_config(path)
    assert str(e.value).startswith(f"{path}: workers[0].role")
    with pytest.raises(ValueError, match="the config: expected a mapping"):
        load_fleet_config(_write(tmp_path, ""))


def test_run_fleet_config_error_exits_2(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_fleet_args(p)
    assert run_fleet(p.parse_args([_write(tmp_path, "workers: [{role: prefill}]\n")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "need at least one 'decode' worker" in err
    assert run_fleet(p.parse_args([str(tmp_path / "missing.yaml")])) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert run_fleet(p.parse_args([os.path.join(CONFIGS, "local-replicas.yaml"), "--port", "70000"])) == 2
    assert "--port: expected a port number" in capsys.readouterr().err


H100_BYTES = 81559 << 20  # an H100 80GB HBM3, as CUDA reports it
AUTOTUNE_SCRATCH = int(1.97 * 2**30)  # what XLA's autotuner asked for at once, compiling the 8B model's steps
COMPILE_THREADS = 4  # runner.warmup compiles this many programs at once, each may autotune


@pytest.mark.parametrize("name", ["gpu1-disaggregated.yaml", "gpu1-replicas.yaml"])
def test_one_gpu_workers_fit_their_allocator_and_leave_the_autotuner_room(name):
    """Each worker of the shipped file, through the serve flags it gets: its pool (from
    --gpu-memory-utilization of an H100, no activations: the largest it can be) and weights fit its
    allocator's share (XLA_PYTHON_CLIENT_MEM_FRACTION), and the two shares fit the card. A pool
    allocated before compiling would leave the autotuner no room, so the engine compiles first
    (engine_setup.py): then all but the weights is free for it."""
    from infire_jax.cli import build_parser
    from infire_jax.engine.args import engine_config
    from infire_jax.engine.setup import resolve_dtype
    from infire_jax.runner.kv_pool import PoolPlanner, size_from_device_memory
    from infire_jax.loaders.load import load_config
    from infire_jax.engine.residency import weight_bytes_bound

    cfg = load_fleet_config(os.path.join(CONFIGS, name))
    fractions = []
    for w in cfg.workers:
        args = build_parser().parse_args(cfg.worker_command(w)[3:])
        config = engine_config(args, args.model[0])
        fractions.append(float(dict(w.env)["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
        limit = int(fractions[-1] * H100_BYTES)
        weights = weight_bytes_bound(config)
        assert weights == 16_060_522_496  # Llama-3.1-8B in bfloat16
        planner = PoolPlanner(PoolPlanner.page_bytes_of(load_config(config.model), None, config.page_size,
                                                        resolve_dtype(config.dtype), 0),
                              config.page_size, 8192, None, None, config.gpu_memory_utilization)
        sizing = size_from_device_memory(device_bytes=H100_BYTES, allocator_limit=limit,
                                         utilization=config.gpu_memory_utilization, weight_bytes=weights,
                                         activation_bytes=0, other_bytes=0, page_bytes=planner.page_bytes,
                                         min_pages=planner.min_pages)
        assert weights + sizing.pool_bytes <= limit
        assert weights + sizing.pool_bytes + AUTOTUNE_SCRATCH > limit  # why the pool waits for the compiles
        assert limit - weights >= COMPILE_THREADS * AUTOTUNE_SCRATCH
    assert sum(fractions) <= 0.95  # CUDA contexts and the other process's share
