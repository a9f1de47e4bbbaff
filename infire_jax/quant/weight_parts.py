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
