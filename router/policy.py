"""Which worker gets a request: session affinity, cache-aware, round-robin or least-load.

Pure bookkeeping, no I/O, so every choice is unit-tested directly. The cache-aware policy follows
SGLang's router: a request goes where its prompt prefix was served before, unless that worker is
much busier than the least busy one. Instead of SGLang's radix tree over characters, each worker
has a bounded LRU set of prompt chunks hashed as a chain (chunk k's hash covers chunks 0..k), so
finding the k-th chunk means the first k match. The chain starts from a hash of the tenant, as
workers salt their prefix cache by tenant: one tenant's prompt never matches another's entries.

Loads are the router's own counts, in token-equivalents (see Load): nothing waits on a scrape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import OrderedDict
from typing import Any, Generic, Protocol, Sequence, TypeVar

POLICIES = ("cache_aware", "round_robin", "least_load")

RUNNING_WEIGHT = 64  # token-equivalents of one request in flight (a decode slot, its transfers)
TEXT_CHUNK = 64  # characters per index chunk of a text prompt (or a chat's serialized messages)
TOKEN_CHUNK = 16  # token ids per index chunk of a token-id prompt
INDEX_CAPACITY = 100_000  # chunk hashes kept per worker
SESSION_CAPACITY = 100_000  # sessions whose last worker is remembered (for the affinity hit ratio)
CACHE_THRESHOLD = 0.5  # the best match must cover this fraction of the prompt's chunks
BALANCE_ABS = 32 * RUNNING_WEIGHT  # SGLang's 32 running requests, in token-equivalents
BALANCE_REL = 1.5


class Load:
    """A worker's outstanding work: `queued_tokens + requests * RUNNING_WEIGHT`.

    Every request in flight counts RUNNING_WEIGHT until it finishes, and the prompt tokens the worker
    has to compute (estimated) until its first byte: its prefill is queued or running until then.
    """

    def __init__(self) -> None:
        self.queued_tokens = 0
        self.requests = 0

    @property
    def outstanding(self) -> int:
        return self.queued_tokens + self.requests * RUNNING_WEIGHT

    def sent(self, tokens: int) -> None:
        self.queued_tokens += tokens
        self.requests += 1

    def answering(self, tokens: int) -> None:
        self.queued_tokens -= tokens

    def finished(self, tokens: int, answered: bool) -> None:
        self.requests -= 1
        if not answered:
            self.queued_tokens -= tokens


class Candidate(Protocol):
    url: str
    load: Load


W = TypeVar("W", bound=Candidate)


# ---- what the router knows of a request ---------------------------------------------------------
def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")  # JSON strings may hold lone surrogates


# What an image part is taken to cost: a Llama 4 image cut into 2 x 2 tiles and its thumbnail, each
# tile 144 <|patch|> tokens, and its markers. The router does not fetch images to count their tiles (1
# to 16, and the thumbnail); a typical photo's is near this, and counting none sent image requests to
# workers as if their prefill were a few text tokens.
IMAGE_TOKENS = 5 * 144 + 8


def _text_chars(content: Any) -> int:
    """Characters of a chat message's content: a string or an array of text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _images(content: Any) -> int:
    """Image parts of a chat message's content."""
    if not isinstance(content, list):
        return 0
    return sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")


def _is_token_ids(p: Any) -> bool:
    return isinstance(p, list) and all(type(t) is int for t in p)


# Where each kind of request keeps its prompts: one string or token-id array, or an array of them.
# A score's two sides and a rerank's documents are embedded each; the first side (the query) keys it.
_PROMPT_FIELDS = {"completions": ("prompt",), "embeddings": ("input",), "rerank": ("query", "documents"),
                  "score": ("text_1", "queries", "data_1", "text_2", "documents", "items", "data_2")}


def _prompts(kind: str, body: dict) -> list:
    """A request's prompts, in the order of its fields (`_PROMPT_FIELDS`)."""
    out = []
    for field in _PROMPT_FIELDS[kind]:
        if field in body:
            out += _listed(body[field])
    return out or [None]


def _listed(prompt) -> list:
    return prompt if isinstance(prompt, list) and prompt and not _is_token_ids(prompt) else [prompt]


def estimate_prompt_tokens(kind: str, body: dict) -> int:
    """Token ids count themselves; text is ~4 characters a token; a chat message adds 4 (its template),
    an image part IMAGE_TOKENS."""
    if kind == "responses":  # text, or items: ~4 characters a token of their JSON
        item = body.get("input")
        return math.ceil(len(item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)) / 4)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        messages = [m for m in messages if isinstance(m, dict)]
        return (math.ceil(sum(_text_chars(m.get("content")) for m in messages) / 4) + 4 * len(messages)
                + IMAGE_TOKENS * sum(_images(m.get("content")) for m in messages))
    return sum(len(p) if _is_token_ids(p) else math.ceil(len(p) / 4) if isinstance(p, str) else 0
               for p in _prompts(kind, body))


def num_prompts(kind: str, body: dict) -> int:
    return 1 if kind in ("chat", "responses") else len(_prompts(kind, body))


def prompt_of(kind: str, body: dict) -> str | list[int]:
    """What the prefix index keys on: the messages serialized canonically, or the (first) prompt.

    A malformed prompt gets a key too (its JSON): the worker rejects it, any key routes it.
    """
    if kind == "chat":
        return json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    if kind == "responses":
        item = body.get("input")
        return item if isinstance(item, str) else json.dumps(item, sort_keys=True, ensure_ascii=False)
    prompt = _prompts(kind, body)[0]  # of a batch, the first: a batch's prompts usually share their prefix
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def prefix_chain(prompt: str | list[int], tenant: str) -> tuple[bytes, ...]:
    """Chained hashes of the prompt's chunks (the last one may be short), seeded by the tenant."""
    if isinstance(prompt, str):
        seed, pieces = b"text", [_utf8(prompt[i:i + TEXT_CHUNK]) for i in range(0, len(prompt), TEXT_CHUNK)]
    else:
        seed, pieces = b"ids", [",".join(map(str, prompt[i:i + TOKEN_CHUNK])).encode()
                                for i in range(0, len(prompt), TOKEN_CHUNK)]
    h = hashlib.blake2b(seed + b"\0" + _utf8(tenant), digest_size=8).digest()
    chain = []
    for piece in pieces:
        h = hashlib.blake2b(h + piece, digest_size=8).digest()  # h has a fixed length: no ambiguity
        chain.append(h)
    return tuple(chain)


@dataclasses.dataclass(frozen=True)
class RouteKey:
    """What routing needs of one request."""

    chain: tuple[bytes, ...]  # prefix_chain of its prompt
    tokens: int  # estimated prompt tokens
    prompts: int = 1  # a completion may carry several (they cannot be prefilled remotely)
    session: str | None = None  # the x-session-affinity header


def route_key(kind: str, body: dict, *, tenant: str = "", session: str | None = None) -> RouteKey:
    """kind: "completions", "chat", "responses", "embeddings", "score" or "rerank"; tenant: whatever separates tenants (the auth and tenant headers)."""
    return RouteKey(prefix_chain(prompt_of(kind, body), tenant), estimate_prompt_tokens(kind, body),
                    num_prompts(kind, body), session)


# ---- bounded memories ---------------------------------------------------------------------------
class PrefixIndex:
    """An LRU set of chunk hashes: the prompt prefixes one worker has been sent, approximately."""

    def __init__(self, capacity: int = INDEX_CAPACITY):
        self._capacity = capacity
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, chain: Sequence[bytes]) -> int:
        """How many leading chunks of the chain the worker has seen."""
        n = 0
        for h in chain:
            if h not in self._entries:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[bytes]) -> None:
        for h in chain:
            self._entries[h] = None
            self._entries.move_to_end(h)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


class SessionMap:
    """The last worker of each recent session (an LRU), to count affinity hits."""

    def __init__(self, capacity: int = SESSION_CAPACITY):
        self._capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def record(self, session: str, url: str) -> bool:
        """Remembers the session's worker; whether it is the same as last time."""
        hit = self._last.get(session) == url
        self._last[session] = url
        self._last.move_to_end(session)
        if len(self._last) > self._capacity:
            self._last.popitem(last=False)
        return hit


def rendezvous(session: str, pool: Sequence[W]) -> W:
    """Highest-random-weight hashing: the worker whose hash with the session is largest.

    Adding a worker moves only the sessions it now wins; removing one moves only its own.
    """
    def weight(w: W) -> bytes:
        return hashlib.blake2b(_utf8(session) + b"\0" + _utf8(w.url), digest_size=8).digest()

    return max(pool, key=weight)


# ---- the policy ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Choice(Generic[W]):
    worker: W
    cached_tokens: int  # estimate of the prompt tokens already in the worker's prefix cache
    reason: str  # "affinity", "cache" (the longest match), "load" (the least loaded), "round_robin"
    affinity_hit: bool | None  # sessions only: the same worker as the session's previous request


class Policy:
    """Chooses workers and remembers what it sent where. Pools are the healthy workers, in a stable order."""

    def __init__(self, name: str = "cache_aware", *, affinity: bool = True, index_capacity: int = INDEX_CAPACITY,
                 session_capacity: int = SESSION_CAPACITY, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL):
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
        self.name = name
        self.affinity = affinity
        self._index_capacity = index_capacity
        self._indexes: dict[str, PrefixIndex] = {}
        self._sessions = SessionMap(session_capacity)
        self._cache_threshold = cache_threshold
        self._balance_abs = balance_abs
        self._balance_rel = balance_rel
        self._next = 0

    def index(self, url: str) -> PrefixIndex:
        if url not in self._indexes:
            self._indexes[url] = PrefixIndex(self._index_capacity)
        return self._indexes[url]

    def choose(self, pool: Sequence[W], key: RouteKey) -> Choice[W]:
        """The worker for a request (a session goes by affinity unless it is off); records the choice."""
        if not pool:
            raise ValueError("no worker to choose from")
        if key.session is not None and self.affinity:
            worker, reason = rendezvous(key.session, pool), "affinity"
        elif self.name == "round_robin":
            worker, reason = pool[self._next % len(pool)], "round_robin"
            self._next += 1
        elif self.name == "least_load":
            worker, reason = min(pool, key=lambda w: w.load.outstanding), "load"
        else:
            worker, reason = self._cache_aware(pool, key)
        index = self.index(worker.url)
        cached = key.tokens * index.match(key.chain) // len(key.chain) if key.chain else 0
        index.insert(key.chain)
        hit = self._sessions.record(key.session, worker.url) if key.session is not None else None
        return Choice(worker, cached, reason, hit)

    def _cache_aware(self, pool: Sequence[W], key: RouteKey) -> tuple[W, str]:
        matched = {w.url: self.index(w.url).match(key.chain) for w in pool}
        least = min(w.load.outstanding for w in pool)
        best = max(pool, key=lambda w: (matched[w.url], -w.load.outstanding))  # ties: the first in order
        slack = max(least + self._balance_abs, least * self._balance_rel)
        if matched[best.url] and matched[best.url] >= self._cache_threshold * len(key.chain) \
                and best.load.outstanding <= slack:
            return best, "cache"
        return min(pool, key=lambda w: (w.load.outstanding, -matched[w.url])), "load"

    @staticmethod
    def choose_prefill(pool: Sequence[W]) -> W:
        """The prefill worker with the fewest prompt tokens sent to it and not yet answered."""
        if not pool:
            raise ValueError("no worker to choose from")
        return min(pool, key=lambda w: w.load.queued_tokens)
