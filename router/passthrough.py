"""Endpoints the router hands to one worker whole: the tokenizer's (every worker answers alike), and the
Responses API's, whose stored responses live on the worker that made them.

A Responses request continuing an earlier one (`previous_response_id`), or asking for a stored one
(`GET /v1/responses/{id}`), goes to the worker that stored it: the router asks its healthy workers
which one has it (a GET with the client's own key and tenant headers, so a worker shows only what
that tenant may see) and remembers the answer. Where none has it, the request goes to any worker,
whose 404 names the id; a new conversation is routed as a chat request is.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from urllib.parse import quote

import aiohttp
from aiohttp import web

from router.proxy import DECODE_ROLES, STATE, RouterState, forward_headers, any_worker, call_one, generate
from router.workers import Worker

_OWNERS_KEPT = 4096  # response id -> the worker that stored it, least recently used first out
_LOOKUP_TIMEOUT_S = 5.0
OWNERS = web.AppKey("response_owners", OrderedDict)


async def tokenize(request: web.Request) -> web.Response:
    return await call_one(request, any_worker(request.app[STATE]), "POST", "/tokenize", await request.read())


async def detokenize(request: web.Request) -> web.Response:
    return await call_one(request, any_worker(request.app[STATE]), "POST", "/detokenize", await request.read())


async def tokenizer_info(request: web.Request) -> web.Response:
    return await call_one(request, any_worker(request.app[STATE]), "GET", request.path_qs)


async def create_response(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses`: to the worker holding the response it continues, if any; else routed."""
    try:
        previous = (await request.json()).get("previous_response_id")
    except (ValueError, AttributeError):
        previous = None  # `generate` answers the malformed body
    owner = await _owner(request, previous) if isinstance(previous, str) else None
    return await generate(request, "responses", "/v1/responses", owner=owner)


async def retrieve_response(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}`: from the worker that stored it (any worker's 404 where none did)."""
    st = request.app[STATE]
    owner = await _owner(request, request.match_info["response_id"]) or any_worker(st)
    return await call_one(request, owner, "GET", f"/v1/responses/{quote(request.match_info['response_id'], safe='')}")


async def _owner(request: web.Request, response_id: str) -> Worker | None:
    """The healthy worker that stored `response_id` for this client, remembered or asked for."""
    st: RouterState = request.app[STATE]
    owners = request.app[OWNERS]
    pool = st.healthy(DECODE_ROLES)
    known = owners.get(response_id)
    if known is not None and known in pool:
        owners.move_to_end(response_id)
        return known
    headers = forward_headers(request)
    found = await asyncio.gather(*(_has(st, w, response_id, headers) for w in pool))
    owner = next((w for w, has in zip(pool, found) if has), None)
    if owner is not None:
        owners[response_id] = owner
        if len(owners) > _OWNERS_KEPT:
            owners.popitem(last=False)
    return owner


async def _has(st: RouterState, worker: Worker, response_id: str, headers: dict[str, str]) -> bool:
    try:
        async with asyncio.timeout(_LOOKUP_TIMEOUT_S):
            async with st.session.get(f"{worker.url}/v1/responses/{quote(response_id, safe='')}",
                                      headers=headers) as up:
                await up.read()
                return up.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False
