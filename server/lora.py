"""LoRA adapters over a served model, as vLLM's server has them: `--lora-modules NAME=PATH` at
start-up, `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` while serving, and each
adapter listed in `/v1/models` with its base model as `parent`. A request's `model` naming an
adapter runs with it (server/endpoints.py).

Loading reads and checks the adapter's files on a worker thread, then registers it on the engine
thread between two steps: nothing recompiles and no running request pauses. Unloading removes the
name at once (later requests naming it get a 404); requests already running with it finish on it
(infire_jax/lora/adapters.py), as in vLLM, where a running request keeps its adapter.
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterable

from aiohttp import web

from infire_jax.errors import InvalidRequestError
from infire_jax.lora.peft import AdapterNotFoundError
from infire_jax.lora.request import LoRARequest
from server.endpoints import STATE, ServedModel, read_json
from server.errors import APIError


def parse_lora_modules(values: Iterable[str]) -> list[tuple[str, str]]:
    """vLLM's `--lora-modules` values: `NAME=PATH`, or JSON `{"name": ..., "path": ...}` (or a list
    of those); ValueError names a malformed one."""
    out = []
    for value in values:
        if value.lstrip().startswith(("{", "[")):
            try:
                items = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from e
            for item in items if isinstance(items, list) else [items]:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str)):
                    raise ValueError(f'--lora-modules JSON needs {{"name": ..., "path": ...}}, got {item!r}')
                out.append((item["name"], item["path"]))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {value!r}")
            out.append((name, path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return out


def lora_model(models: dict[str, ServedModel]) -> ServedModel:
    """The served model whose engine serves LoRA adapters; a 400 when none does."""
    for m in models.values():
        if m.engine.engine.lora is not None:
            return m
    raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora", param="lora_name")


def add_static(m: ServedModel, modules: list[tuple[str, str]]) -> None:
    """Loads `--lora-modules` before the engine thread starts (so on this thread); raises naming the
    first adapter that cannot be served."""
    lora = m.engine.engine.lora
    for name, path in modules:
        if name in (m.name, *m.aliases):
            raise ValueError(f"the LoRA adapter name {name!r} is a served model's name")
        request = LoRARequest(name, lora.free_id(), path)
        lora.register(request)
        m.adapters[name] = request


def _name(body, field: str = "lora_name") -> str:
    value = body.get(field) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{field}' must be a non-empty string", param=field)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`{"lora_name": ..., "lora_path": ...}`: reads, checks and registers the adapter."""
    st = request.app[STATE]
    body = await read_json(request)
    if not isinstance(body, dict) or not body.get("lora_name") or not body.get("lora_path"):
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    name, path = _name(body), _name(body, "lora_path")
    m = lora_model(st.models)
    if any(name in (x.name, *x.aliases, *x.adapters) or name in x.loading for x in st.models.values()):
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    m.loading.add(name)  # taken before any await: a load of the same name meanwhile is refused
    engine = m.engine.engine
    try:
        adapter = await asyncio.get_running_loop().run_in_executor(None, engine.lora.read_path, path)
        # its id is taken on the engine thread, which registers one adapter at a time
        entry = await m.engine.call(lambda e: e.lora.register(LoRARequest(name, e.lora.free_id(), path), adapter))
    except AdapterNotFoundError as e:
        raise APIError(404, str(e), param="lora_path", code="lora_not_found") from e
    finally:
        m.loading.discard(name)
    m.adapters[name] = entry.request
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """`{"lora_name": ...}`: the name is gone at once; requests running with it finish on it."""
    st = request.app[STATE]
    name = _name(await read_json(request))
    m = next((x for x in st.models.values() if name in x.adapters), None)
    if m is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found")
    del m.adapters[name]  # first: no request admitted from here on names it
    try:
        await m.engine.call(lambda e: e.lora.unregister(name))
    except InvalidRequestError as e:
        raise APIError(404, str(e), param="lora_name", code="lora_not_found") from e
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def model_cards(m: ServedModel, created: int) -> list[dict]:
    """`/v1/models` entries of a served model's adapters, vLLM's fields: `root` the adapter's path,
    `parent` the base model."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "infire-jax", "root": r.lora_path,
             "parent": m.name, "max_model_len": m.max_model_len} for name, r in m.adapters.items()]
