"""YaRN rotary scaling as the DeepSeek-V3 family's and gpt-oss's configs use it (HF `_compute_yarn_parameters`).

Three numbers come out of a YaRN config: the blended inverse frequencies, a factor on cos/sin
(`attention_factor`, mscale / mscale_all_dim) and a factor on the softmax scale (mscale_all_dim's
mscale squared, DeepSeek's `yarn_apply_mscale`). They are separate because HF applies them at
different places, and rounding follows where they are applied.
"""

from __future__ import annotations

import math

import numpy as np

from infire_jax.models.config import ModelConfig, RopeScaling


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(cfg: ModelConfig, dim: int) -> np.ndarray:
    """Inverse frequencies [dim / 2] for the rotary dimension `dim`, YaRN-blended when configured."""
    base = cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return (1.0 / pos_freqs).astype(np.float32)
    if rs.kind != "yarn":
        raise ValueError(f"rope scaling {rs.kind!r} is not YaRN")
    old = rs.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:  # HF's default; gpt-oss keeps the fractional bounds
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


def cos_sin_factor(rs: RopeScaling | None) -> float:
    """HF's `attention_scaling`: multiplies cos and sin."""
    if rs is None:
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return _mscale(rs.factor, rs.mscale) / _mscale(rs.factor, rs.mscale_all_dim)
    return _mscale(rs.factor)


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= _mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale
