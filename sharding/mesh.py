"""Mesh configuration: one YAML file per device count, validated before anything loads.

A file names the mesh axes and their sizes, and the logical-axis rules that say which mesh axis
shards each parameter / KV axis:

    mesh: {dp: 1, pp: 2, tp: 4, ep: 1}
    rules: {vocab: tp, q_heads: tp, kv_heads: tp, mlp: tp, experts: ep, layers: pp}

Logical axes not named in `rules` are replicated.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import yaml

MESH_AXES = ("dp", "pp", "tp", "ep")
# Each logical axis may be sharded over exactly these mesh axes (or replicated, `null`).
ALLOWED_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("tp",),
    "q_heads": ("tp",),
    "kv_heads": ("tp",),
    "mlp": ("tp",),
    "experts": ("ep", "tp"),  # tp: expert parallel over the devices that split attention
    "layers": ("pp",),
    "embed": (),
    "head_dim": (),
    "norm": (),
    "router": (),
    "qkv": (),  # the fused q/k/v weight's (G queries, k, v) axis
    "gate_up": (),  # the fused gate/up weight's (gate, up) axis
}
# Logical axes that follow another's rule: a Gated DeltaNet's (models/qwen3_5.py) channels, v values and
# heads split as the attention heads do, so one `q_heads: tp` splits every layer of a Qwen3.5 by head.
ALIASES = {"linear_qkv": "q_heads", "linear_value": "q_heads", "linear_heads": "q_heads"}
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


class MeshConfigError(ValueError):
    """A mesh file is malformed, or does not fit the devices or the model."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    name: str
    axes: tuple[tuple[str, int], ...]  # (axis, size) in MESH_AXES order
    rules: tuple[tuple[str, str | None], ...]  # (logical axis, mesh axis or None), sorted

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def num_devices(self) -> int:
        n = 1
        for _, size in self.axes:
            n *= size
        return n

    def rule(self, logical: str) -> str | None:
        """The mesh axis sharding `logical` (or the axis it follows, ALIASES), or None when it is replicated
        (or its axis has size 1)."""
        axis = dict(self.rules).get(ALIASES.get(logical, logical))
        return axis if axis is not None and self.sizes[axis] > 1 else None

    @classmethod
    def parse(cls, raw: Any, name: str) -> "MeshConfig":
        def bad(msg: str):
            raise MeshConfigError(f"{name}: {msg}")

        if not isinstance(raw, Mapping):
            bad("expected a mapping with keys 'mesh' and 'rules'")
        unknown = set(raw) - {"mesh", "rules", "description"}
        if unknown:
            bad(f"unknown keys {sorted(unknown)}; expected 'mesh', 'rules' (and optional 'description')")
        mesh = raw.get("mesh")
        if not isinstance(mesh, Mapping) or not mesh:
            bad("'mesh' must map axis names to sizes, e.g. {tp: 2}")
        unknown = set(mesh) - set(MESH_AXES)
        if unknown:
            bad(f"unknown mesh axes {sorted(unknown)}; the axes are {list(MESH_AXES)}")
        sizes = {}
        for axis in MESH_AXES:
            size = mesh.get(axis, 1)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                bad(f"mesh axis {axis!r} must be a positive integer, got {size!r}")
            sizes[axis] = size
        if sizes["dp"] != 1:
            bad("dp > 1 is not supported: run one engine per data-parallel replica behind a router")
        rules = raw.get("rules") or {}
        if not isinstance(rules, Mapping):
            bad("'rules' must map logical axes to mesh axes")
        for logical, axis in rules.items():
            if logical not in ALLOWED_RULES:
                bad(f"unknown logical axis {logical!r}; known: {sorted(ALLOWED_RULES)}")
            if axis is not None and axis not in ALLOWED_RULES[logical]:
                allowed = ", ".join([*ALLOWED_RULES[logical], "null"])
                bad(f"logical axis {logical!r} cannot be sharded over {axis!r} (allowed: {allowed})")
        if sizes["pp"] > 1 and rules.get("layers") != "pp":
            bad("pp > 1 needs the rule 'layers: pp'")
        if (rules.get("q_heads") is None) != (rules.get("kv_heads") is None):
            bad("q_heads and kv_heads must both be sharded over tp or both replicated")
        return cls(name=name, axes=tuple((a, sizes[a]) for a in MESH_AXES),
                   rules=tuple(sorted((k, v) for k, v in rules.items())))

    @classmethod
    def from_yaml(cls, path: str) -> "MeshConfig":
        if not os.path.isfile(path):
            raise MeshConfigError(f"mesh file {path} does not exist")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise MeshConfigError(f"{path}: not valid YAML: {e}") from e
        return cls.parse(raw, path)

    @classmethod
    def single_device(cls) -> "MeshConfig":
        return cls.parse({"mesh": {"tp": 1}}, "single-device")

    def check_devices(self, available: int) -> None:
        if self.num_devices > available:
            raise MeshConfigError(f"{self.name}: the mesh needs {self.num_devices} devices, "
                                  f"but only {available} are available")


def shipped_config_path(num_devices: int) -> str:
    """The packaged mesh file for a device count."""
    path = os.path.join(CONFIG_DIR, f"{num_devices}.yaml")
    if not os.path.isfile(path):
        have = sorted(int(f[:-5]) for f in os.listdir(CONFIG_DIR) if f[:-5].isdigit())
        raise MeshConfigError(f"no shipped mesh config for {num_devices} devices (shipped: {have}); "
                              "pass one with --mesh FILE")
    return path


def parallel_config(tp: int, pp: int, expert_parallel: bool) -> MeshConfig:
    """vLLM's -tp/-pp/--enable-expert-parallel as a mesh: the rules of the shipped files (2.yaml,
    2-pp2.yaml, 8-tp4-pp2.yaml, 8-tp8-ep.yaml) for these sizes; experts over tp as vLLM's EP (each whole)."""
    rules: dict[str, str] = {}
    if tp > 1:
        rules.update(vocab="tp", q_heads="tp", kv_heads="tp", mlp="tp")
        if expert_parallel:
            rules["experts"] = "tp"
    if pp > 1:
        rules["layers"] = "pp"
    name = f"-tp {tp} -pp {pp}" + (" --enable-expert-parallel" if expert_parallel else "")
    return MeshConfig.parse({"mesh": {"tp": tp, "pp": pp}, "rules": rules}, name)


def load_mesh_config(mesh: str | MeshConfig | None, num_devices: int) -> MeshConfig:
    """`mesh` (a file, or a config built from flags), or the shipped file for `num_devices` devices,
    validated against the device count."""
    mc = mesh if isinstance(mesh, MeshConfig) else MeshConfig.from_yaml(mesh or shipped_config_path(num_devices))
    mc.check_devices(num_devices)
    return mc
