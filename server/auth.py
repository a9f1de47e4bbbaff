"""API keys and tenants. A tenant salts the prefix cache, so tenants never share KV pages.

With `--api-key` given, every /v1 request needs `Authorization: Bearer <key>` and its tenant is the
key's (`key:tenant`; a key without one is its own tenant). Without keys, the `x-tenant-id` header
names the tenant (no header: the shared default tenant).
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from server.errors import APIError

TENANT_HEADER = "x-tenant-id"
_MAX_TENANT_LEN = 256


def parse_api_keys(specs: list[str]) -> dict[str, str]:
    """`KEY` or `KEY:TENANT` (split at the last colon) -> {key: tenant}."""
    keys: dict[str, str] = {}
    for spec in specs:
        key, sep, tenant = spec.rpartition(":")
        if not sep:
            key, tenant = spec, "key-" + hashlib.sha256(spec.encode()).hexdigest()[:16]
        if not key or not tenant:
            raise ValueError(f"--api-key {spec!r}: expected KEY or KEY:TENANT with both parts non-empty")
        keys[key] = tenant
    return keys


class Auth:
    def __init__(self, api_keys: dict[str, str]):
        self._keys = [(k.encode(), t) for k, t in api_keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, request: web.Request) -> str | None:
        """The request's tenant; raises a 401 APIError when keys are required and this one is wrong."""
        if not self._keys:
            return _header_tenant(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                                "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        given_b = given.strip().encode()
        tenant = None
        for key, t in self._keys:  # compare with every key, in constant time each
            if hmac.compare_digest(key, given_b):
                tenant = t
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant


def _header_tenant(request: web.Request) -> str | None:
    tenant = request.headers.get(TENANT_HEADER)
    if tenant is None:
        return None
    if not tenant or len(tenant) > _MAX_TENANT_LEN:
        raise APIError(400, f"the {TENANT_HEADER} header must be 1 to {_MAX_TENANT_LEN} characters")
    return tenant


AUTH = web.AppKey("auth", Auth)
TENANT: web.RequestKey[str | None] = web.RequestKey("tenant")


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Checks the key of every /v1 request and stores its tenant under request[TENANT]."""
    if request.path.startswith("/v1/"):
        request[TENANT] = request.app[AUTH].tenant(request)
    return await handler(request)


def salted_tenant(tenant: str | None, cache_salt: str | None) -> str | None:
    """What separates a request's prefix-cache pages: its tenant and vLLM's `cache_salt` together."""
    return tenant if cache_salt is None else f"{tenant or ''}\0salt\0{cache_salt}"
