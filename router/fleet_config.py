"""The fleet YAML file (`infire-jax fleet FILE`), validated into a FleetConfig; router/fleet.py runs it.

Unknown keys are errors, and every error names the key path (`workers[1].role: ...`). The schema is
in router/fleet.py's docstring.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any, Callable, Iterable, Sequence

import yaml

ROLES = ("prefill", "decode", "both")
ROUTER_ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "both": "--worker"}
# Flags the fleet sets itself; in `args` they are errors.
_WORKER_OWNED = ("--host", "--port", "--role", "--model")
_ROUTER_OWNED = ("--host", "--port", "--prefill", "--decode", "--worker")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None
    cpus: tuple[int, ...] | None = None
    gpus: tuple[int, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8000
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    workers: tuple[WorkerSpec, ...]
    router: RouterSpec = RouterSpec()
    model: str | None = None
    worker_args: tuple[str, ...] = ()
    source: str = "<config>"

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "both" for w in self.workers)

    def roles(self) -> dict[str, int]:
        """Number of workers per role, roles with none left out."""
        counts = {r: sum(w.role == r for w in self.workers) for r in ROLES}
        return {r: n for r, n in counts.items() if n}

    def describe(self) -> str:
        """One line: the workers by role and the router's own flags, e.g.
        `1 prefill + 1 decode; router --policy cache_aware`."""
        workers = " + ".join(f"{n} {r}" for r, n in self.roles().items())
        router = " ".join(self.router.args) or "(default flags)"
        return f"{workers}; router {router}"

    def worker_command(self, w: WorkerSpec, python: str = sys.executable) -> list[str]:
        model = w.model if w.model is not None else self.model
        cmd = [python, "-m", "infire_jax", "serve", "--host", w.host, "--port", str(w.port), "--role", w.role]
        if model is not None:
            cmd += ["--model", model]
        return cmd + list(self.worker_args) + list(w.args)


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _mapping(value: Any, path: str, allowed: Iterable[str]) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{path or 'the config'}: expected a mapping, got {type(value).__name__} {value!r}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ValueError(f"{_where(path, unknown[0])}: unknown key (expected one of {', '.join(sorted(allowed))})")
    return value


def _string(value: Any, path: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def check_port(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{path}: expected a port number in 0..65535 (0: any free port), got {value!r}")
    return value


def _flags(value: Any, path: str, owned: Sequence[str]) -> tuple[str, ...]:
    """A list of command-line words; numbers become strings. Flags the fleet sets are errors."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a list of command-line words, got {value!r}")
    words = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ValueError(f"{path}[{i}]: expected a string or a number, got {v!r}")
        words.append(str(v))
    for i, word in enumerate(words):
        if word.split("=", 1)[0] in owned:
            raise ValueError(f"{path}[{i}]: {word!r} is set by the fleet itself "
                             f"(it owns {', '.join(owned)}; use the config's keys)")
    return tuple(words)


def _indices(value: Any, path: str, *, limit: int | None, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}: expected a non-empty list of {what} indices, got {value!r} "
                         "(leave the key out to not restrict)")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (limit is not None and v >= limit):
            bound = f" in 0..{limit - 1} (this machine has {limit} CPUs)" if limit is not None else " >= 0"
            raise ValueError(f"{path}[{i}]: expected a {what} index{bound}, got {v!r}")
    return tuple(dict.fromkeys(value))


def _worker(value: Any, path: str, index_in_role: Callable[[str], int]) -> WorkerSpec:
    d = _mapping(value, path, {"name", "role", "host", "port", "model", "cpus", "gpus", "env", "args"})
    role = d.get("role")
    if role not in ROLES:
        raise ValueError(f"{path}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    name = d.get("name")
    if name is None:
        name = f"{role}{index_in_role(role)}"
    elif not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{path}.name: expected letters, digits, '.', '_' or '-' (a log file is named after it), "
                         f"got {name!r}")
    return WorkerSpec(
        name=name, role=role, host=_string(d.get("host", "127.0.0.1"), f"{path}.host"),
        port=check_port(d.get("port", 0), f"{path}.port"), model=_string(d.get("model"), f"{path}.model", optional=True),
        cpus=_indices(d.get("cpus"), f"{path}.cpus", limit=os.cpu_count() or 1, what="CPU"),
        gpus=_indices(d.get("gpus"), f"{path}.gpus", limit=None, what="GPU"),
        env=_env(d.get("env"), f"{path}.env"), args=_flags(d.get("args"), f"{path}.args", _WORKER_OWNED))


def _env(value: Any, path: str) -> tuple[tuple[str, str], ...]:
    """Environment variables of one worker (e.g. XLA_PYTHON_CLIENT_MEM_FRACTION when workers share a GPU)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, (str, int, float))
                                              and not isinstance(v, bool) for k, v in value.items()):
        raise ValueError(f"{path}: expected a mapping of variable names to strings or numbers, got {value!r}")
    return tuple((k, str(v)) for k, v in value.items())


def parse_fleet_config(data: Any, source: str = "<config>") -> FleetConfig:
    """A validated FleetConfig from the parsed YAML document; ValueError names the bad key or value."""
    d = _mapping(data, "", {"model", "worker_args", "router", "workers"})
    r = _mapping(d.get("router") or {}, "router", {"host", "port", "args"})
    router = RouterSpec(host=_string(r.get("host", "127.0.0.1"), "router.host"),
                        port=check_port(r.get("port", 8000), "router.port"),
                        args=_flags(r.get("args"), "router.args", _ROUTER_OWNED))
    raw = d.get("workers")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"workers: expected a non-empty list of workers, got {raw!r}")
    seen_roles: dict[str, int] = {}

    def index_in_role(role: str) -> int:
        seen_roles[role] = seen_roles.get(role, 0) + 1
        return seen_roles[role] - 1

    workers = tuple(_worker(w, f"workers[{i}]", index_in_role) for i, w in enumerate(raw))
    names: dict[str, int] = {}
    for i, w in enumerate(workers):
        if w.name in names:
            raise ValueError(f"workers[{i}].name: {w.name!r} is also the name of workers[{names[w.name]}]")
        names[w.name] = i
    roles = {w.role for w in workers}
    if roles != {"both"} and not {"prefill", "decode"} <= roles:
        missing = "decode" if "prefill" in roles else "prefill"
        raise ValueError(f"workers: roles {sorted(roles)} need at least one {missing!r} worker "
                         "(either every worker is 'both', or there are 'prefill' and 'decode' workers)")
    ports: dict[int, str] = {}
    for where, port in [("router.port", router.port)] + [(f"workers[{i}].port", w.port) for i, w in enumerate(workers)]:
        if port and port in ports:
            raise ValueError(f"{where}: port {port} is also {ports[port]}")
        ports[port] = where
    return FleetConfig(workers=workers, router=router, model=_string(d.get("model"), "model", optional=True),
                       worker_args=_flags(d.get("worker_args"), "worker_args", _WORKER_OWNED), source=source)


def load_fleet_config(path: str) -> FleetConfig:
    """Reads and validates a fleet YAML file; ValueError (or OSError for an unreadable file)."""
    with open(path) as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    try:
        return parse_fleet_config(data, source=path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
