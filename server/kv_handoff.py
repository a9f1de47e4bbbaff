"""The worker side of prefill/decode disaggregation: `kv_transfer_params`, as vLLM's workers speak it.

A prefill worker (`serve --role prefill`) given `"kv_transfer_params": {"do_remote_decode": true}`
runs the request (a router sends `max_tokens: 1`), copies the prompt's cached full pages into its
Mooncake staging buffer, holds them there, and answers with `kv_transfer_params` that say where
they are (its transfer engine, the region's address and size, the layout, how many tokens and a
digest of them, the first sampled token). A decode worker (`--role decode`) given those params
with the same request reserves a region of its own staging buffer, reads the held one in one
Mooncake transfer, then asks the prefill worker over HTTP to release it. Only if the hold was
still live when it was released are the bytes known to be intact (an expired hold's region may
have been reused): then they are imported into the prefix cache under the hash chain this worker
computes from its own tokens and the request's own tenant, and the request runs as a prefix hit.

Any transport failure (the prefill worker died, the hold expired, no room in the buffer) makes the
decode worker compute the prompt itself: a slower answer, never a wrong one. Holds expire after
`hold_seconds`; a region is returned only after the thread or engine call that uses it finished.

Nothing waits for the expiry when someone knows the hold is no longer wanted: a prefill worker
whose answer never reached its client releases the hold itself (`export`), and a decode worker
releases the hold its request names whenever it does not import it (`Claim`), so vLLM's proxies,
which never release, leak nothing either.

A generation request meets all of this in one place, `request_handoff`: opened once its body is
read, it names the hold the body claims (released when the request ends without importing it), and
its `before` (the params' checks, a decode worker's pull) and `answer` (a prefill worker's export,
the answer written while the hold is made) are the one step before generation and the one after.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import time
from typing import Any, AsyncIterator, Iterator, Mapping

import aiohttp
from aiohttp import web

from infire_jax.engine.async_engine import AsyncEngine
from infire_jax.errors import InvalidRequestError
from infire_jax.kv_transfer import KVBlocks, KVLayout
from infire_jax.kv_transfer.blocks import describe_groups, groups_from_json, groups_to_json
from infire_jax.kv_transfer.mooncake import MooncakeTransport, Reservation
from infire_jax.lora.adapters import lora_digest
from server.errors import APIError
from server.responses import Choice

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
RELEASE_PATH = "/v1/kv_transfer/release"
_FORWARDED = ("authorization", "x-tenant-id")  # the release runs as the same client, hence the same tenant
_PARAM = "kv_transfer_params"
_RELEASE_TIMEOUT_S = 5.0  # a release a decode worker gives up on: past this, the hold expires instead


def tokens_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _bad(message: str) -> APIError:
    return APIError(400, message, param=_PARAM)


@dataclasses.dataclass(frozen=True)
class _Held:
    region: Reservation
    tenant: str | None
    deadline: float


@dataclasses.dataclass
class Claim:
    """The hold a decode request's `kv_transfer_params` name, released once: by the pull's confirmation,
    or else in the background as soon as the request stops wanting it (a pull that failed, or a
    request refused before its pull), without waiting for a router to do it."""

    url: str
    transfer_id: str
    headers: dict[str, str]  # the client's Authorization and x-tenant-id: a hold is released per tenant
    pulling: bool = False  # a pull owns it: it settles the claim however it ends
    released: bool = False  # a release was sent


@dataclasses.dataclass
class Pulled:
    """What a decode worker imported for one request (reported in response headers and metrics)."""

    num_bytes: int
    seconds: float
    pages: int  # written into the pool (a hybrid cache's: over its groups)


KV_PULLED: web.RequestKey[Pulled | None] = web.RequestKey("kv_pulled")  # set when a pull was asked (response headers)


class KVHandoff:
    """One worker's transfer engine, its staging buffer, and the holds it serves."""

    def __init__(self, engine: AsyncEngine, role: str, *, buffer_bytes: int, host: str, hold_seconds: float,
                 metrics=None):
        if role not in ("prefill", "decode"):
            raise ValueError(f"a KV handoff serves role prefill or decode, not {role!r}")
        self.engine = engine
        self.role = role
        self.hold_seconds = hold_seconds
        self._buffer_bytes = buffer_bytes
        self._host = host
        self._metrics = metrics
        self._holds: dict[str, _Held] = {}
        self._pending: set[asyncio.Task] = set()  # pulls that own a region until they finish
        self.transport: MooncakeTransport | None = None
        self._http: aiohttp.ClientSession | None = None
        self._reaper: asyncio.Task | None = None

    @property
    def layout(self) -> KVLayout:
        return self.engine.engine.kv_layout

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    @property
    def free_bytes(self) -> int:
        """The staging buffer's room (none before start)."""
        return self.transport.free_bytes if self.transport is not None else 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport = await loop.run_in_executor(
            None, lambda: MooncakeTransport(self._buffer_bytes, host=self._host))
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._reaper = asyncio.create_task(self._expire_holds())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    # ---- prefill side ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def export(self, prompt: list[int], tenant: str | None, public_url: str, first_token: int | None,
                     first_logprob: float | None, lora_name: str | None = None,
                     image_digest: str | None = None) -> AsyncIterator[dict | None]:
        """Holds the prompt's cached full pages (computed with the LoRA adapter `lora_name`, and the
        images of `image_digest`, whose KV a decode worker takes without encoding them) and yields
        the `kv_transfer_params` a decode worker needs (None when no full page is cached: a prompt
        shorter than a page). Send them inside the block: if it raises or is cancelled (the client
        left), nobody can know the transfer id, so the hold is released at once."""
        blocks, adapter = await self.engine.call(
            lambda e: (e.export_prompt_kv(prompt, tenant=tenant, lora_name=lora_name, image_digest=image_digest),
                       lora_digest(e.lora, lora_name)))
        region = await self._hold(blocks) if blocks.num_blocks else None
        if region is None:
            yield None
            return
        transfer_id = secrets.token_hex(16)
        self._holds[transfer_id] = _Held(region, tenant, time.monotonic() + self.hold_seconds)
        layout = blocks.layout
        host, _, port = public_url.rpartition("//")[2].rpartition(":")
        try:
            yield {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": region.target, "remote_host": host, "remote_port": int(port) if port else None,
                "remote_url": public_url, "transfer_id": transfer_id, "remote_address": region.address,
                "num_bytes": region.nbytes, "num_tokens": len(blocks.token_ids),
                "tokens_digest": tokens_digest(blocks.token_ids), "expires_in_s": self.hold_seconds,
                "layout": {"model": layout.model, "dtype": layout.dtype, "page_size": layout.page_size,
                           "page_shape": list(layout.page_shape),
                           "v_page_shape": list(layout.v_page_shape) if layout.v_page_shape else None,
                           "kv_scales": layout.kv_scales, "groups": groups_to_json(layout.groups)},
                "first_token_id": first_token, "first_token_logprob": first_logprob,
                "lora_digest": adapter,  # the LoRA adapter the KV was computed with (None: the base model)
            }
        except BaseException:
            self._drop(transfer_id)
            raise

    async def _hold(self, blocks: KVBlocks) -> Reservation | None:
        """The blocks copied into a region of the staging buffer (None: no room). A cancel cannot stop
        the copy's thread: the region it takes after its caller left is returned when the copy ends."""
        copy = asyncio.get_running_loop().run_in_executor(None, self.transport.hold, blocks)
        try:
            return await asyncio.shield(copy)
        except InvalidRequestError as e:  # no room: the decode worker computes the prompt itself
            log.warning("KV export skipped: %s", e)
            self._count_failure("no_room")
            return None
        except asyncio.CancelledError:
            copy.add_done_callback(self._return_region)
            raise

    def _return_region(self, copy: asyncio.Future) -> None:
        if not copy.cancelled() and copy.exception() is None:
            self.transport.release(copy.result())

    def release(self, transfer_id: Any, tenant: str | None) -> bool:
        """Frees a hold; False when there is none of that id for this tenant (expired, or never made)."""
        held = self._holds.get(transfer_id) if isinstance(transfer_id, str) else None
        if held is None or held.tenant != tenant:
            return False
        self._drop(transfer_id)
        return True

    def _drop(self, transfer_id: str) -> None:
        held = self._holds.pop(transfer_id, None)
        if held is not None:
            self.transport.release(held.region)

    async def _expire_holds(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.hold_seconds / 4))
            now = time.monotonic()
            for tid in [t for t, h in self._holds.items() if h.deadline <= now]:
                self._drop(tid)
                log.warning("a KV hold expired before any decode worker fetched it (%s)", tid)
                self._count_failure("expired")

    # ---- decode side -------------------------------------------------------------------------------
    def _check(self, params: dict, prompt: list[int], lora_name: str | None) -> tuple[Reservation, int]:
        """The held region and the token count the params name; a 400 when they are malformed, made
        for another model, layout or LoRA adapter, or for another prompt."""
        def field(name: str, kind: type) -> Any:
            v = params.get(name)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise _bad(f"'{_PARAM}.{name}' is missing or not {'an integer' if kind is int else 'a string'}; "
                           "pass the kv_transfer_params a prefill worker returned")
            return v

        layout = params.get("layout")
        if not isinstance(layout, dict):
            raise _bad(f"'{_PARAM}.layout' is missing; pass the kv_transfer_params a prefill worker returned")
        mine = self.layout
        try:
            groups = groups_from_json(layout.get("groups"))
        except ValueError as e:
            raise _bad(f"'{_PARAM}.layout.groups': {e}; pass the kv_transfer_params a prefill worker returned")
        if groups != mine.groups:
            raise _bad(f"the transferred KV does not fit this worker: its layers are grouped as "
                       f"{describe_groups(groups)} on the prefill worker and {describe_groups(mine.groups)} here "
                       "(serve the same model with the same hybrid KV cache setting)")
        theirs = {"model": layout.get("model"), "dtype": layout.get("dtype"), "page_size": layout.get("page_size"),
                  "page_shape": tuple(layout.get("page_shape") or ()),
                  "v_page_shape": tuple(layout["v_page_shape"]) if layout.get("v_page_shape") else None,
                  "kv_scales": layout.get("kv_scales")}
        for name, value in theirs.items():
            if getattr(mine, name) != value:
                raise _bad(f"the transferred KV does not fit this worker: {name} is {value!r} on the prefill "
                           f"worker and {getattr(mine, name)!r} here (serve the same model, dtype, kv cache dtype and page size)")
        num_tokens = field("num_tokens", int)
        if num_tokens % mine.page_size or not 0 < num_tokens <= len(prompt):
            raise _bad(f"'{_PARAM}.num_tokens' ({num_tokens}) must be a positive multiple of the page size "
                       f"({mine.page_size}) within the prompt ({len(prompt)} tokens)")
        if field("tokens_digest", str) != tokens_digest(prompt[:num_tokens]):
            raise _bad(f"the '{_PARAM}' were made for another prompt")
        if params.get("lora_digest") != lora_digest(self.engine.engine.lora, lora_name):
            raise _bad(f"the transferred KV was computed with another LoRA adapter than `{lora_name or 'none'}` here "
                       "(serve the same adapter files under the same name on both workers)")
        source = Reservation(field("remote_engine_id", str), field("remote_address", int), 0,
                             field("num_bytes", int))
        if source.nbytes != mine.payload_nbytes(num_tokens // mine.page_size):
            raise _bad(f"'{_PARAM}.num_bytes' ({source.nbytes}) does not match {num_tokens} tokens of this layout")
        return source, num_tokens

    def claim(self, body: Any, headers: Mapping[str, str]) -> Claim | None:
        """The hold a request body's `kv_transfer_params` ask this decode worker to pull, if they name
        one (its HTTP address and id), whether or not the rest of the params or the body are valid."""
        params = body.get(_PARAM) if isinstance(body, dict) else None
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        url, transfer_id = params.get("remote_url"), params.get("transfer_id")
        if not (isinstance(url, str) and url.startswith(("http://", "https://")) and isinstance(transfer_id, str)):
            return None
        return Claim(url.rstrip("/"), transfer_id, {k: v for k, v in headers.items() if k.lower() in _FORWARDED})

    def settle(self, claim: Claim) -> None:
        """The request is over: its hold is released unless a pull owns it or released it already."""
        if not claim.pulling:
            self._let_go(claim)

    def _let_go(self, claim: Claim) -> None:
        """Releases the hold in a task of its own, once: the request computes its prompt meanwhile."""
        if claim.released:
            return
        claim.released = True
        task = asyncio.create_task(self._release_remote(claim))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release_remote(self, claim: Claim) -> None:
        """Best effort: a 404 means the hold is gone already (a router released it, or it expired)."""
        try:
            status = await self._post_release(claim, aiohttp.ClientTimeout(total=_RELEASE_TIMEOUT_S))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("could not release KV hold %s on %s (it expires instead): %r", claim.transfer_id, claim.url, e)
            return
        if status not in (200, 404):
            log.warning("releasing KV hold %s on %s answered %d (it expires instead)", claim.transfer_id, claim.url,
                        status)

    async def pull(self, claim: Claim | None, params: dict, prompt: list[int], tenant: str | None,
                   lora_name: str | None = None, image_digest: str | None = None) -> Pulled | None:
        """Fetches and imports the prompt's pages a prefill worker holds (`claim`: the hold `params`
        name); None when the transfer failed (the request then computes its prompt here, and the hold
        is released now). Malformed params raise a 400 (the caller's `settle` releases the hold).
        `image_digest`: the digest of the request's images as this worker cut them (engine/images.py),
        which keys the pages as a local prefill would, so their image tokens are a prefix hit here."""
        if claim is None:
            raise _bad(f"'{_PARAM}.remote_url' (http or https) and '{_PARAM}.transfer_id' must name the hold; "
                       "pass the kv_transfer_params a prefill worker returned")
        source, num_tokens = self._check(params, prompt, lora_name)
        try:
            region = self.transport.reserve(source.nbytes)
        except InvalidRequestError as e:  # no room: compute locally
            log.warning("KV pull skipped: %s", e)
            self._count_failure("no_room")
            self._let_go(claim)
            return None
        claim.pulling = True
        task = asyncio.create_task(self._fetch_and_import(source, region, claim, prompt[:num_tokens], tenant,
                                                          lora_name, image_digest))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        # The task owns the region and the claim until it ends; a client that leaves does not cut it short.
        return await asyncio.shield(task)

    async def _fetch_and_import(self, source: Reservation, region: Reservation, claim: Claim,
                                token_ids: list[int], tenant: str | None, lora_name: str | None,
                                image_digest: str | None) -> Pulled | None:
        try:
            seconds = await asyncio.get_running_loop().run_in_executor(None, self.transport.fetch, source, region)
            if not await self._confirm(claim):
                self._count_failure("hold_gone")
                return None
            blocks = self.transport.received(region, self.layout, token_ids, tenant)
            written = await self.engine.call(lambda e: e.import_prompt_kv(blocks, lora_name, image_digest))
            if self._metrics is not None:
                self._metrics.kv_transferred(region.nbytes, seconds)
            return Pulled(region.nbytes, seconds, written)
        except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("KV pull from %s failed, computing the prompt here: %s", claim.url, e)
            self._count_failure("transport")
            return None
        finally:
            self.transport.release(region)
            self._let_go(claim)  # unless confirmed: the read failed, or something else did

    async def _confirm(self, claim: Claim) -> bool:
        """Releases the hold; True only if it was still live (so the bytes read were intact)."""
        claim.released = True
        return await self._post_release(claim) == 200

    async def _post_release(self, claim: Claim, timeout: aiohttp.ClientTimeout | None = None) -> int:
        async with self._http.post(claim.url + RELEASE_PATH, json={"transfer_id": claim.transfer_id},
                                   headers=claim.headers, timeout=timeout or self._http.timeout) as r:
            return r.status

    def _count_failure(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.kv_transfer_failed(reason)


# ---- one generation request ------------------------------------------------------------------------
class RequestHandoff:
    """One generation request's part in a KV handoff, whatever this worker's role (a plain server,
    `handoff` None, refuses kv_transfer_params). The endpoint calls `before` just before generating
    and `answer` with the formatted body; the claim is settled by `request_handoff`."""

    def __init__(self, handoff: KVHandoff | None, request: web.Request, claim: Claim | None):
        self._handoff = handoff
        self._request = request
        self._claim = claim
        # a prefill worker's prompt, tenant, LoRA adapter and images' digest
        self._export: tuple[list[int], str | None, str | None, str | None] | None = None

    @property
    def role(self) -> str:
        return self._handoff.role if self._handoff is not None else "both"

    async def before(self, params: dict | None, prompts: list[list[int]], tenant: str | None, *,
                     stream: bool, lora_name: str | None = None, image_digest: str | None = None) -> None:
        """Checks that the request's kv_transfer_params (None: none asked) ask for what this worker's
        role serves, on one prompt. A decode worker then imports the prompt's pages, so the request
        runs as a prefix hit (the response's headers say how the pull went), its images' tokens among
        them never encoded. `lora_name`: the request's LoRA adapter, whose KV only its own requests
        may use; `image_digest`: its images' (engine/images.py), whose KV only prompts of the same
        images may use."""
        if params is None:
            return
        want = "prefill" if params.get("do_remote_decode") else "decode"
        if self.role != want:
            flag = "do_remote_decode" if want == "prefill" else "do_remote_prefill"
            raise _bad(f"kv_transfer_params with {flag} need a worker started with --role {want}; this one's role "
                       f"is {self.role}")
        if len(prompts) != 1:
            raise _bad("kv_transfer_params need a request with one prompt")
        if want == "prefill":
            if stream:
                raise APIError(400, "kv_transfer_params with do_remote_decode need a non-streaming request",
                               param="stream")
            self._export = (prompts[0], tenant, lora_name, image_digest)
        else:
            self._request[KV_PULLED] = await self._handoff.pull(self._claim, params, prompts[0], tenant, lora_name,
                                                                image_digest)

    async def answer(self, body: dict, first: Choice) -> web.StreamResponse:
        """The whole (non-streaming) response. A prefill worker's names the KV it holds for the
        decode worker, and is written here rather than after the handler returns: if the client
        leaves before it is written (a cancel, or a reset write), `export` releases the hold."""
        if self._export is None:
            return web.json_response(body)
        prompt, tenant, lora_name, image_digest = self._export
        token = first.token_ids[0] if first.token_ids else None
        logprob = first.logprobs[0].get(token) if first.logprobs and token is not None else None
        request = self._request
        response = web.Response(content_type="application/json")
        with contextlib.suppress(ConnectionResetError):  # the client went away: nobody reads this answer
            async with self._handoff.export(prompt, tenant, f"{request.scheme}://{request.host}", token,
                                            logprob, lora_name, image_digest) as params:
                response.text = json.dumps({**body, _PARAM: params})
                await response.prepare(request)
                await response.write_eof()
        return response


@contextlib.contextmanager
def request_handoff(handoff: KVHandoff | None, request: web.Request, body: Any) -> Iterator[RequestHandoff]:
    """A generation request's handoff, from its body on. On a decode worker, the hold the body's
    kv_transfer_params name is released when the request ends without importing it, also when it is
    refused before its pull (a field the prefill worker never saw, such as min_tokens): no router has
    to be there to do it."""
    claim = handoff.claim(body, request.headers) if handoff is not None and handoff.role == "decode" else None
    try:
        yield RequestHandoff(handoff, request, claim)
    finally:
        if claim is not None:
            handoff.settle(claim)
