"""Block sizes of the quantized matmul (quant_matmul.py), chosen per shape and overridable for sweeps.

A weight-only quantized matmul at decode sizes is a stream of the weight bytes: what matters is
that enough programs run (about two per SM of an H100's 132, split along K when N alone gives too
few), that each moves about 16 KB of weights per step of its K loop, and that rows are not padded
to Triton's 16-row dot tile when there are one or two of them (then the `gemv` form multiplies in
registers). `choose` is a small table keyed on the rows per tile, K, N, the packing and the scale
group; `INFIRE_JAX_QUANT_BLOCKS` replaces any of its fields (a `Blocks` passed in, all of them),
so a GPU session can sweep `candidates` with `python -m pallas_kernels.benchmark --quant --sweep`
and write the winners back here.
"""

from __future__ import annotations

import dataclasses
import os

INPUTS_PER_ITEM = {"int4": 8, "q4_1": 2, "mxfp4": 2, None: 1}
BLOCK_PACKINGS = ("q4_1", "mxfp4")  # 32 inputs a scale, 16 bytes of two nibbles
MIN_DOT = 16  # Triton's smallest dot extent (rows, and K of each piece)
MAX_TILE_ROWS = 64  # rows a program holds accumulators for
GEMV_MAX_ROWS = 4  # the register (no dot) form takes tiles of at most this many rows
TARGET_PROGRAMS = 264  # about two per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 16
# The pipeline stages' shared memory a chosen tiling may take: 90% of what an H100 / H200 block may
# opt into (232,448 bytes), the rest for Triton's own scratch.
SHARED_BUDGET = 209_000
ENV = "INFIRE_JAX_QUANT_BLOCKS"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One launch's tiling: `block_k` inputs per K step, `tile_n` outputs per program, K split over
    `splits` programs (0: chosen from the grid), Triton's warps and pipeline stages, and whether a
    tile of at most GEMV_MAX_ROWS rows multiplies in registers instead of a padded dot."""

    block_k: int = 128
    tile_n: int = 64
    splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    gemv: bool = False

    def fits(self, k: int, n: int, packing: str | None) -> bool:
        """Whether this tiling divides [k, n] into whole blocks of whole packed items."""
        return k % self.block_k == 0 and n % self.tile_n == 0 and self.block_k >= min_block_k(packing) and \
            self.tile_n >= MIN_DOT and _pow2(self.block_k) and _pow2(self.tile_n)

    def label(self) -> str:
        return ",".join(f"{f.name}={int(getattr(self, f.name))}" for f in dataclasses.fields(self))


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def min_block_k(packing: str | None) -> int:
    """Smallest K step: a Q4_1 or MXFP4 block (32 inputs in two 16-input halves), else MIN_DOT inputs
    (int4 steps under 8 x 16 inputs read a word per input, quant_matmul._pieces)."""
    return 32 if packing in BLOCK_PACKINGS else MIN_DOT


def parse(text: str) -> dict:
    """`block_k=256,tile_n=128,gemv=1` -> the fields it names (ValueError on an unknown one)."""
    names = {f.name: f.type for f in dataclasses.fields(Blocks)}
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        if key not in names:
            raise ValueError(f"{ENV}: unknown field {key!r}; fields: {sorted(names)}")
        out[key] = bool(int(value)) if key == "gemv" else int(value)
    return out


def _largest(limit: int, divides: int, floor: int) -> int:
    b = limit
    while b > floor and divides % b:
        b //= 2
    return b


def choose(rows: int, k: int, n: int, packing: str | None, override: Blocks | None = None, group: int = 0,
           x_bytes: int = 2) -> Blocks:
    """The tiling for tiles of `rows` rows of a [k, n] weight with scales per `group` inputs (0: none),
    whose x tiles load `x_bytes` a row and input (2 for bfloat16; a fused SwiGLU loads float32 gate
    and up partials): `override` whole if given, else the heuristic below with the fields
    INFIRE_JAX_QUANT_BLOCKS names replaced; it may not fit: `fits` says."""
    if override is not None:
        return override
    gemv = rows <= 2
    # About 16 KB of weight items a K step (int8 [128, 128], int4 words [32, 128]; 32 KB for bf16 [128, 128]).
    item_bytes = {"int4": 4 / 8, "q4_1": 1 / 2, "mxfp4": 1 / 2}.get(packing, 1)
    tile_n = _largest(128 if gemv or rows <= 16 else 64, n, MIN_DOT)
    want_k = int(16384 // (item_bytes * tile_n))
    if packing not in BLOCK_PACKINGS and 128 <= group < want_k:  # a step within one group loads one scale row, not one a row
        want_k = group
    block_k = _largest(min(want_k, 512), k, min_block_k(packing))
    stages = 3
    # Each pipeline stage holds the step's x tile (rows padded to a dot) beside the weight items and
    # their scales: wide tiles of many rows outgrow the shared memory (a Q4_1 step of 64 rows with
    # block_k 512 asked an H100 for 239,616 bytes of its 232,448: tests/test_quant_matmul.py).
    while block_k > min_block_k(packing) and \
            stages * _stage_bytes(rows, block_k, tile_n, item_bytes, x_bytes) > SHARED_BUDGET:
        block_k //= 2
    blocks = Blocks(block_k=block_k, tile_n=tile_n, num_warps=4, num_stages=stages, gemv=gemv)
    env = os.environ.get(ENV)
    return dataclasses.replace(blocks, **parse(env)) if env else blocks


def _stage_bytes(rows: int, block_k: int, tile_n: int, item_bytes: float, x_bytes: int = 2) -> int:
    """An upper bound of one pipeline stage's shared memory: the x tile (rows padded to a power of
    two, at least MIN_DOT), the weight items, and two float32 scale rows per 32 inputs."""
    padded = max(MIN_DOT, 1 << max(rows - 1, 0).bit_length())
    return int(padded * block_k * x_bytes + block_k * item_bytes * tile_n + 2 * max(1, block_k // 32) * tile_n * 4)


def splits_for(blocks: Blocks, programs: int, k_blocks: int) -> int:
    """K splits: `blocks.splits` if set, else the fewest that give TARGET_PROGRAMS programs; at most
    one per K block."""
    wanted = blocks.splits or -(-TARGET_PROGRAMS // max(programs, 1))
    return max(1, min(wanted, MAX_SPLITS, k_blocks))


def candidates(rows: int, k: int, n: int, packing: str | None) -> list[Blocks]:
    """What a sweep tries for one shape (at most 36, a few seconds of compiling each): the fitting
    combinations of three K steps, three column tiles, 4 or 8 warps and (for tiles of at most
    GEMV_MAX_ROWS rows) both forms, three pipeline stages and automatic splits."""
    out = []
    for gemv in ((False, True) if rows <= GEMV_MAX_ROWS else (False,)):
        for block_k in (128, 256, 512):
            for tile_n in (64, 128, 256):
                for num_warps in (4, 8):
                    b = Blocks(block_k, tile_n, 0, num_warps, 3, gemv)
                    if b.fits(k, n, packing):
                        out.append(b)
    return out
