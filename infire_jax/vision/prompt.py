"""An image's placeholder in a Llama 4 prompt, as transformers' Llama4Processor expands it.

The chat template renders an image content part as `<|image|>`; the processor replaces it with the
image's tokens: `<|image_start|>`, then for more than one tile each row of tiles as runs of
`<|patch|>` (one run a tile, `<|tile_x_separator|>` between the tiles of a row, and
`<|tile_y_separator|>` after each row), then `<|image|>` and the thumbnail's run, then
`<|image_end|>`. The encoder's outputs replace the `<|patch|>` tokens, tiles in the same order.
"""

from __future__ import annotations

IMAGE = "<|image|>"
START, END, PATCH = "<|image_start|>", "<|image_end|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"


def image_tokens(grid: tuple[int, int], tokens_per_tile: int) -> list[str]:
    """The placeholder of an image cut into `grid` (tiles down, across), as special-token strings."""
    rows, cols = grid
    out = [START]
    if rows * cols > 1:
        for _ in range(rows):
            for x in range(cols):
                out += [PATCH] * tokens_per_tile
                if x < cols - 1:
                    out.append(TILE_X)
            out.append(TILE_Y)
    out += [IMAGE] + [PATCH] * tokens_per_tile + [END]
    return out


def expand(text: str, grids: list[tuple[int, int]], tokens_per_tile: int) -> str:
    """`text` with its i-th `<|image|>` replaced by image i's placeholder; ValueError unless the
    counts match."""
    return replace_markers(text, IMAGE, ["".join(image_tokens(g, tokens_per_tile)) for g in grids])


def replace_markers(text: str, marker: str, placeholders: list[str]) -> str:
    """`text` with its i-th `marker` replaced by `placeholders[i]`; ValueError unless the counts match
    (any tower's prompt: vision/towers.py)."""
    parts = text.split(marker)
    if len(parts) - 1 != len(placeholders):
        raise ValueError(f"the prompt has {len(parts) - 1} {marker} markers for {len(placeholders)} images")
    return parts[0] + "".join(p + rest for p, rest in zip(placeholders, parts[1:]))
