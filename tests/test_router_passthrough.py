"""The router's Responses API and tokenizer endpoints, in one process: the real router app over two
fake `both` workers that store responses per worker and tenant, as server/responses_api.py does. A
continuation (previous_response_id) and a retrieval go to the worker that stored the response,
whichever the routing policy would pick; the tokenizer's endpoints go to any worker."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
from aiohttp import web

from router.app import RouterConfig, build_router_app
from test_router_holds import _health, _serving

_ids = itertools.count()


class FakeWorker:
    def __init__(self, name: str):
        self.name = name
        self.stored: dict[tuple[str | None, str], dict] = {}  # (tenant, id) -> response
        self.app = web.Application()
        self.app.router.add_get("/health", _health("both"))
        self.app.router.add_post("/v1/responses", self._create)
        self.app.router.add_get("/v1/responses/{response_id}", self._retrieve)
        self.app.router.add_post("/tokenize", self._tokenize)

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        tenant = request.headers.get("x-tenant-id")
        previous = body.get("previous_response_id")
        if previous is not None and (tenant, previous) not in self.stored:
            return web.json_response({"error": {"message": f"Previous response with id '{previous}' not found.",
                                                "type": "invalid_request_error", "param": "previous_response_id",
                                                "code": "previous_response_not_found"}}, status=404)
        response = {"id": f"resp_{next(_ids)}", "worker": self.name, "previous": previous}
        self.stored[tenant, response["id"]] = response
        return web.json_response(response)

    async def _retrieve(self, request: web.Request) -> web.Response:
        found = self.stored.get((request.headers.get("x-tenant-id"), request.match_info["response_id"]))
        if found is None:
            return web.json_response({"error": {"message": "not found", "type": "invalid_request_error",
                                                "param": "response_id", "code": "response_not_found"}}, status=404)
        return web.json_response(found)

    async def _tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, 2], "worker": self.name, "asked": await request.json()})


def test_responses_follow_the_worker_that_stored_them():
    async def main() -> None:
        a, b = FakeWorker("a"), FakeWorker("b")
        async with _serving(a.app) as (a_url, _), _serving(b.app) as (b_url, _):
            config = RouterConfig(workers=((a_url, "both"), (b_url, "both")), policy="round_robin",
                                  health_interval=60, request_timeout=30)
            async with _serving(build_router_app(config)) as (router, _), aiohttp.ClientSession() as s:
                async def post(path: str, body: dict, tenant: str = "t1") -> tuple[int, dict]:
                    async with s.post(router + path, json=body, headers={"x-tenant-id": tenant}) as r:
                        return r.status, await r.json()

                async def get(path: str, tenant: str = "t1") -> tuple[int, dict]:
                    async with s.get(router + path, headers={"x-tenant-id": tenant}) as r:
                        return r.status, await r.json()

                status, first = await post("/v1/responses", {"model": "m", "input": "hi"})
                assert status == 200
                chain = [first]
                for _ in range(4):  # round robin alone would alternate the workers
                    status, nxt = await post("/v1/responses", {"model": "m", "input": "more",
                                                               "previous_response_id": chain[-1]["id"]})
                    assert status == 200 and nxt["worker"] == first["worker"], nxt
                    chain.append(nxt)
                status, got = await get(f"/v1/responses/{chain[2]['id']}")
                assert status == 200 and got == chain[2]
                # another tenant cannot see it: the owner lookup asks with the client's own headers
                status, err = await get(f"/v1/responses/{chain[2]['id']}", tenant="t2")
                assert status == 404 and err["error"]["code"] == "response_not_found"
                status, err = await post("/v1/responses", {"model": "m", "input": "x",
                                                           "previous_response_id": "resp_nope/../../health"})
                assert status == 404 and err["error"]["code"] == "previous_response_not_found"
                status, out = await post("/tokenize", {"prompt": "hi"})
                assert status == 200 and out["asked"] == {"prompt": "hi"} and out["tokens"] == [1, 2]
                async with s.post(router + "/ping") as r:  # vLLM's health check, as a worker answers it
                    assert r.status == 200 and (await r.json())["status"] == "ok"
                assert (await get("/version"))[1]["version"]

    asyncio.run(main())
