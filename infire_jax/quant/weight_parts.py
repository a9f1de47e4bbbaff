"""A stacked weight held as several arrays (compressed or quantized parts) in place of one `nnx.Param`."""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array


class WeightParts(nnx.Module):
    """Its parts are `nnx.Param` attributes, each with logical axes; the layer scan takes them as a dict."""

    def arrays(self) -> dict[str, Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    def axes(self) -> dict[str, tuple[str | None, ...]]:
        return {k: v.axes for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class LayerStacks(nnx.Module):
    """A model's stacked layer weights, each an `nnx.Param` or a weight held as parts (an instance of
    `PARTS`: anything with `arrays()` and `axes()`), handed to the layer loop and the mesh's shard_map."""

    PARTS: tuple[type, ...] = (WeightParts,)

    def arrays(self) -> dict[str, Array | dict[str, Array]]:
        """The stacked arrays by attribute name (a dict of parts, or a part's own form, for a weight of parts)."""
        return {k: v[...] if isinstance(v, nnx.Param) else v.arrays()
                for k, v in vars(self).items() if isinstance(v, (nnx.Param, *self.PARTS))}

    def axes(self) -> dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]]:
        """Each stacked array's logical axis names, in the same structure as `arrays`."""
        return {k: v.axes if isinstance(v, nnx.Param) else v.axes()
                for k, v in vars(self).items() if isinstance(v, (nnx.Param, *self.PARTS))}
