"""Output of a benchmark: a table for the terminal, a JSON file, and a throughput-latency PNG."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

Column = tuple[str, str, str]  # (result key, header, format)


@dataclasses.dataclass
class Result:
    payload: dict[str, Any]  # everything the JSON file holds
    table: str
    points: list[dict]  # for the plot: label, throughput (tok/s), ttft_ms, tpot_ms, and optionally series
    title: str


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """Right-aligned text table; a missing or None figure prints as "-"."""
    def cell(row, key, fmt):
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    cells = [[header for _, header, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: they become null (an infinite request rate is written as "inf" upstream)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(payload), f, indent=2, allow_nan=False)
        f.write("\n")


def plot(path: str, points: Sequence[dict], title: str) -> None:
    """TTFT and TPOT against output throughput, one annotated point per sweep point (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    series = list(dict.fromkeys(p.get("series", "") for p in points))
    for ax, key, name in zip(fig.subplots(1, 2), ("ttft_ms", "tpot_ms"), ("TTFT (ms)", "TPOT (ms/token)")):
        for s in series:
            shown = [(p["throughput"], p[key], p["label"]) for p in points if p.get("series", "") == s
                     and p["throughput"] is not None and p[key] is not None]
            ax.plot([x for x, _, _ in shown], [y for _, y, _ in shown], marker="o", label=s or None)
            for x, y, label in shown:
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if len(series) > 1:
            ax.legend()
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)


def emit(result: Result, json_path: str | None, plot_path: str | None) -> None:
    print(result.title)
    print(result.table)
    if json_path:
        write_json(json_path, result.payload)
        print(f"wrote {json_path}")
    if plot_path:
        plot(plot_path, result.points, result.title)
        print(f"wrote {plot_path}")
