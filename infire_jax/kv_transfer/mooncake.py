"""KV blocks over Mooncake Transfer Engine: the transport Infire uses between prefill and decode.

Each side runs one `TransferEngine` (TCP here; RDMA where the hardware and the CUDA build of the
wheel are present) with one staging buffer registered once at start. A receiver hands out regions
of its buffer (`reserve`); the sender copies a request's k and v pages into its own buffer and
writes both into the receiver's region in one batched transfer. What is sent where (the region's
address, the layout, the tokens and the tenant) travels as control messages beside it (HTTP
between workers); here that is `Reservation` and the `KVBlocks` header.

The Debian package libibverbs1 must be installed for the wheel to load, even over TCP.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.kv_transfer.blocks import KVBlocks, KVLayout

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
    """A region of a receiver's staging buffer, handed to a sender."""

    target: str  # the receiver's "host:port"
    address: int  # start of the region in the receiver's address space
    offset: int  # start of the region in the receiver's buffer
    nbytes: int


class MooncakeTransport:
    """One process's end: a transfer engine and a registered staging buffer of `buffer_bytes`."""

    def __init__(self, buffer_bytes: int, *, host: str = "127.0.0.1", protocol: str = "tcp"):
        self._engine = _transfer_engine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise ConfigError(f"Mooncake transfer engine failed to start on {host} over {protocol} (rc={rc})")
        self.host = host
        self.buffer = np.zeros(buffer_bytes, np.uint8)
        self._base = self.buffer.ctypes.data
        if self._engine.register_memory(self._base, buffer_bytes) != 0:
            raise ConfigError(f"Mooncake could not register a staging buffer of {buffer_bytes} bytes")
        self._free: list[tuple[int, int]] = [(0, buffer_bytes)]  # (offset, size), sorted by offset

    @property
    def address(self) -> str:
        return f"{self.host}:{self._engine.get_rpc_port()}"

    # ---- receiving side ------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> Reservation:
        """A region for one incoming transfer (first fit); `release` gives it back."""
        for i, (off, size) in enumerate(self._free):
            if size >= nbytes:
                self._free[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                return Reservation(self.address, self._base + off, off, nbytes)
        raise InvalidRequestError(f"no room in the KV staging buffer for {nbytes} bytes "
                                  f"({len(self.buffer)} in all)", param="kv_transfer")

    def release(self, r: Reservation) -> None:
        """Returns a region (after its blocks were imported, or the transfer failed or timed out)."""
        self._free.append((r.offset, r.nbytes))
        self._free.sort()
        merged = [self._free[0]]
        for off, size in self._free[1:]:
            last_off, last_size = merged[-1]
            if last_off + last_size == off:
                merged[-1] = (last_off, last_size + size)
            else:
                merged.append((off, size))
        self._free = merged

    def received(self, r: Reservation, layout: KVLayout, token_ids: list[int], tenant: str | None) -> KVBlocks:
        """The blocks a sender wrote into `r`, as views of the staging buffer (import them, then release)."""
        num_blocks = len(token_ids) // layout.page_size
        dtype = np.dtype(layout.dtype) if layout.dtype != "bfloat16" else _bfloat16()
        shape = (layout.page_shape[0], num_blocks, *layout.page_shape[1:])
        half = int(np.prod(shape)) * dtype.itemsize
        if 2 * half != r.nbytes:
            raise InvalidRequestError(f"{r.nbytes} bytes reserved for {2 * half} bytes of blocks", param="kv_transfer")
        region = self.buffer[r.offset:r.offset + r.nbytes]
        k = region[:half].view(dtype).reshape(shape)
        v = region[half:].view(dtype).reshape(shape)
        return KVBlocks(layout, token_ids, tenant, k, v)

    # ---- sending side --------------------------------------------------------------------------
    def send(self, blocks: KVBlocks, to: Reservation) -> float:
        """Writes k and v into the reserved region in one batched transfer; returns the seconds it took."""
        if blocks.nbytes != to.nbytes:
            raise InvalidRequestError(f"{blocks.nbytes} bytes of blocks for a region of {to.nbytes}",
                                      param="kv_transfer")
        local = self.reserve(blocks.nbytes)
        try:
            half = blocks.k.nbytes
            self.buffer[local.offset:local.offset + half] = np.ascontiguousarray(blocks.k).view(np.uint8).reshape(-1)
            self.buffer[local.offset + half:local.offset + 2 * half] = \
                np.ascontiguousarray(blocks.v).view(np.uint8).reshape(-1)
            start = time.perf_counter()
            rc = self._engine.batch_transfer_sync_write(to.target, [local.address, local.address + half],
                                                        [to.address, to.address + half], [half, half])
            seconds = time.perf_counter() - start
        finally:
            self.release(local)
        if rc != 0:
            raise ConnectionError(f"Mooncake transfer of {blocks.nbytes} bytes to {to.target} failed (rc={rc})")
        return seconds


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
