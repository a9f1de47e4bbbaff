"""Images of chat requests: the bytes behind an `image_url`, as vLLM takes them.

- `data:` URLs (base64; `image/*`);
- `http(s)` URLs, fetched with aiohttp within a time and size limit, answered with an `image/*` type,
  from any host or only from `--allowed-media-domains`;
- `file:` URLs, only under `--allowed-local-media-path` (none by default).

Anything else, or a fetch that fails, is the client's error: a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import urllib.parse

import aiohttp

from infire_jax.vision import preprocess
from server.protocol import bad


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: str | None = None  # file: URLs under this directory; None: none
    allowed_domains: tuple[str, ...] | None = None  # http(s) hosts; None: any
    max_bytes: int = 20 << 20
    timeout_seconds: float = 10.0


async def image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The encoded image behind `url` (module docstring); APIError 400 naming `param` otherwise."""
    if not isinstance(url, str) or not url:
        raise bad(f"'{param}' must be a non-empty URL string", param)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, policy, param)
    if scheme in ("http", "https"):
        return await _fetch(url, policy, param)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, policy, param)
    raise bad(f"'{param}': unsupported image URL scheme {scheme!r}; use data:, http(s): or file:", param)


def _data_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    try:
        return preprocess.data_url_bytes(url, policy.max_bytes)
    except preprocess.ImageError as e:
        raise bad(f"'{param}': {e}", param) from e


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    if policy.allowed_domains is not None and host not in policy.allowed_domains:
        raise bad(f"'{param}': images are fetched only from {', '.join(policy.allowed_domains)} "
                  f"(--allowed-media-domains), not {host!r}", param)
    try:
        timeout = aiohttp.ClientTimeout(total=policy.timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as r:
            if r.status != 200:
                raise bad(f"'{param}': fetching the image gave HTTP {r.status}", param)
            if not r.content_type.startswith("image/"):
                raise bad(f"'{param}': the URL answered {r.content_type!r}, not an image", param)
            data = await r.content.read(policy.max_bytes + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise bad(f"'{param}': the image could not be fetched ({type(e).__name__}: {e})", param) from e
    if len(data) > policy.max_bytes:
        raise bad(f"'{param}': the image is larger than {policy.max_bytes} bytes", param)
    return data


def _local_file(url: str, policy: MediaPolicy, param: str) -> bytes:
    if policy.allowed_local_path is None:
        raise bad(f"'{param}': file: URLs are read only under --allowed-local-media-path, which is not set", param)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(policy.allowed_local_path)
    if os.path.commonpath([path, root]) != root:
        raise bad(f"'{param}': {path} is outside --allowed-local-media-path", param)
    try:
        if os.path.getsize(path) > policy.max_bytes:
            raise bad(f"'{param}': the image is larger than {policy.max_bytes} bytes", param)
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise bad(f"'{param}': cannot read {path} ({e.strerror})", param) from e
