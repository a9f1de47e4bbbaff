"""Latency statistics and goodput, named as `vllm bench serve` names them.

TTFT: request sent -> first token. TPOT: (E2E - TTFT) / (output tokens - 1), per request.
ITL: the gap between successive streamed chunks. E2EL: request sent -> last token.
Goodput: completed requests per second that met every given SLO.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestTiming:
    """One request's client-side timing, in seconds."""

    ttft: float
    e2el: float
    itl: list[float]
    prompt_tokens: int
    output_tokens: int

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentiles_arg(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def slo_arg(text: str) -> tuple[str, float]:
    """Parses one `--goodput` item, `metric:milliseconds`."""
    name, _, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if name not in SLO_METRICS or not ms > 0:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} "
                                         f"and MS > 0, got {text!r}")
    return name, ms


def pct_label(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def latency_stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std and the given percentiles of `seconds`, in ms, keyed like `mean_ttft_ms`."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"{pct_label(p)}_{name}_ms" for p in percentiles]
    if len(seconds) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, np.float64) * 1000
    values = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, list(percentiles))]
    return {k: float(v) for k, v in zip(keys, values)}


def meets_slos(t: RequestTiming, slos: dict[str, float]) -> bool:
    """Whether one request met every SLO (in ms); TPOT of a one-token request counts as met."""
    values = {"ttft": t.ttft, "tpot": t.tpot, "e2el": t.e2el}
    return all(values[name] is None or values[name] * 1000 <= ms for name, ms in slos.items())


def summarize(timings: Sequence[RequestTiming], duration: float, percentiles: Sequence[float],
              slos: dict[str, float] | None = None) -> dict:
    """Throughput, latency statistics and goodput of the completed requests of one run."""
    prompt_tokens = sum(t.prompt_tokens for t in timings)
    output_tokens = sum(t.output_tokens for t in timings)
    out = dict(completed=len(timings), duration_s=duration, total_input_tokens=prompt_tokens,
               total_output_tokens=output_tokens, request_throughput=len(timings) / duration,
               output_throughput=output_tokens / duration,
               total_token_throughput=(prompt_tokens + output_tokens) / duration)
    if slos:
        good = sum(meets_slos(t, slos) for t in timings)
        out["request_goodput"] = good / duration
        out["good_requests"] = good
    out |= latency_stats("ttft", [t.ttft for t in timings], percentiles)
    out |= latency_stats("tpot", [t.tpot for t in timings if t.tpot is not None], percentiles)
    out |= latency_stats("itl", [gap for t in timings for gap in t.itl], percentiles)
    out |= latency_stats("e2el", [t.e2el for t in timings], percentiles)
    return out
