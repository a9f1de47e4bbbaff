"""KV blocks over Mooncake Transfer Engine: the transport Infire uses between prefill and decode.

Each side runs one `TransferEngine` (TCP here; RDMA where the hardware and the CUDA build of the
wheel are present) with one staging buffer registered once at start. The sender copies a
request's k and v pages into a region of its buffer (`hold`); the receiver reserves a region of
its own and reads the sender's into it in one transfer (`fetch`), the way vLLM's decode workers
pull KV over NIXL, so a prefill worker never needs to know which decode worker comes next. What
is where (the region's address, the layout, the tokens) travels as control messages beside it
(HTTP between workers, server/kv_handoff.py); here that is `Reservation` and the `KVBlocks` header.

The Debian package libibverbs1 must be installed for the wheel to load, even over TCP.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.kv_transfer.blocks import KVBlocks, KVLayout, numpy_dtype

_INSTALL_HINT = ("Mooncake needs the Python wheel and libibverbs: `pip install mooncake-transfer-engine-non-cuda` "
                 "and, as root, `apt-get install -y libibverbs1 ibverbs-providers` (./run.sh does both)")


def _transfer_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel is missing, or libibverbs.so.1 is
        raise ConfigError(f"cannot load Mooncake ({e}). {_INSTALL_HINT}") from e
    return TransferEngine()


@dataclasses.dataclass(frozen=True)
class Reservation:
    """A region of one process's staging buffer; `target` names that process's transfer engine."""

    target: str  # the owner's "host:port"
    address: int  # start of the region in the owner's address space
    offset: int  # start of the region in the owner's buffer
    nbytes: int


class MooncakeTransport:
    """One process's end: a transfer engine and a registered staging buffer of `buffer_bytes`."""

    def __init__(self, buffer_bytes: int, *, host: str = "127.0.0.1", protocol: str = "tcp"):
        self._engine = _transfer_engine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise ConfigError(f"Mooncake transfer engine failed to start on {host} over {protocol} (rc={rc})")
        self.host = host
        self.protocol = protocol
        self.buffer = np.zeros(buffer_bytes, np.uint8)
        self._base = self.buffer.ctypes.data
        if self._engine.register_memory(self._base, buffer_bytes) != 0:
            raise ConfigError(f"Mooncake could not register a staging buffer of {buffer_bytes} bytes")
        self._free: list[tuple[int, int]] = [(0, buffer_bytes)]  # (offset, size), sorted by offset
        self._lock = threading.Lock()  # regions are taken and returned from several threads

    @property
    def address(self) -> str:
        return f"{self.host}:{self._engine.get_rpc_port()}"

    # ---- regions of the staging buffer ---------------------------------------------------------
    def reserve(self, nbytes: int) -> Reservation:
        """A region of `nbytes` (first fit); `release` gives it back."""
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= nbytes:
                    self._free[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                    return Reservation(self.address, self._base + off, off, nbytes)
        raise InvalidRequestError(f"no room in the KV staging buffer for {nbytes} bytes "
                                  f"({len(self.buffer)} in all)", param="kv_transfer")

    def release(self, r: Reservation) -> None:
        """Returns a region (its blocks were imported or fetched, or the transfer failed or timed out)."""
        with self._lock:
            free = sorted([*self._free, (r.offset, r.nbytes)])
            merged = [free[0]]
            for off, size in free[1:]:
                last_off, last_size = merged[-1]
                if last_off + last_size == off:
                    merged[-1] = (last_off, last_size + size)
                else:
                    merged.append((off, size))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    # ---- sending side --------------------------------------------------------------------------
    def hold(self, blocks: KVBlocks) -> Reservation:
        """Copies k then v into a region of the staging buffer, where a receiver `fetch`es them;
        `release` it once the receiver says it is done (or a deadline passes)."""
        r = self.reserve(blocks.nbytes)
        half = blocks.k.nbytes
        self.buffer[r.offset:r.offset + half] = np.ascontiguousarray(blocks.k).view(np.uint8).reshape(-1)
        self.buffer[r.offset + half:r.offset + r.nbytes] = np.ascontiguousarray(blocks.v).view(np.uint8).reshape(-1)
        return r

    # ---- receiving side --------------------------------------------------------------------------
    def fetch(self, source: Reservation, into: Reservation) -> float:
        """Reads a sender's held region into a reserved local one in one transfer; returns its seconds.

        Blocking (call it off the event loop); raises ConnectionError when Mooncake reports a failure.
        """
        if source.nbytes != into.nbytes:
            raise InvalidRequestError(f"{source.nbytes} bytes held for a region of {into.nbytes}",
                                      param="kv_transfer_params")
        start = time.perf_counter()
        rc = self._engine.batch_transfer_sync_read(source.target, [into.address], [source.address], [into.nbytes])
        seconds = time.perf_counter() - start
        if rc != 0:
            raise ConnectionError(f"Mooncake read of {into.nbytes} bytes from {source.target} failed (rc={rc})")
        return seconds

    def received(self, r: Reservation, layout: KVLayout, token_ids: list[int], tenant: str | None) -> KVBlocks:
        """The blocks fetched into `r`, as views of the staging buffer (import them, then release)."""
        dtype = numpy_dtype(layout.dtype)
        shape, v_shape = layout.payload_shapes(len(token_ids) // layout.page_size)
        half = int(np.prod(shape)) * dtype.itemsize
        total = half + int(np.prod(v_shape)) * dtype.itemsize
        if total != r.nbytes:
            raise InvalidRequestError(f"{r.nbytes} bytes reserved for {total} bytes of blocks", param="kv_transfer")
        region = self.buffer[r.offset:r.offset + r.nbytes]
        k = region[:half].view(dtype).reshape(shape)
        v = region[half:].view(dtype).reshape(v_shape)
        return KVBlocks(layout, token_ids, tenant, k, v)

