"""Counts XLA compilations, so tests and the engine can prove nothing compiles after warmup, and
the executables loaded from the persistent compilation cache instead (the boot timeline)."""

from __future__ import annotations

import contextlib
import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_cache_hits = 0


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE:
        with _lock:
            _count += 1


def _on_hit(event: str, **kwargs) -> None:
    global _cache_hits
    if event == _CACHE_HIT:
        with _lock:
            _cache_hits += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
jax.monitoring.register_event_listener(_on_hit)


def compile_count() -> int:
    """Backend compilations in this process so far, loads from the persistent cache included (hits
    of jit's in-memory cache do not count)."""
    return _count


def cache_hit_count() -> int:
    """Executables loaded from the persistent compilation cache in this process so far."""
    return _cache_hits


class RecompileError(RuntimeError):
    pass


@contextlib.contextmanager
def forbid_compiles():
    """Raises RecompileError if anything compiles inside the block."""
    before = _count
    yield
    if _count != before:
        raise RecompileError(f"{_count - before} XLA compilation(s) happened after warmup")
