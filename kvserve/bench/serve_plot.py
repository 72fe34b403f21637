"""`kvserve bench serve --plot`: latency distributions and output throughput over time, in one PNG."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvserve.bench.serve import THROUGHPUT_BIN_S, ServeResult


def plot_result(result: ServeResult, path: Path) -> None:
    # a Figure on an Agg canvas, not pyplot: no global backend or window state, safe off the main thread
    fig = Figure(figsize=(13, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ttft, tpot), (e2el, tput) = fig.subplots(2, 2)
    ok = [r for r in result.records if r.success]
    _distribution(ttft, {"TTFT": [r.ttft_s for r in ok]}, "time to first token (ms)")
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    _distribution(tpot, {"TPOT": tpots, "ITL": [g for r in ok for g in r.itl_s]}, "per output token (ms)")
    _distribution(e2el, {"E2E": [r.e2el_s for r in ok]}, "end-to-end latency (ms)")
    _throughput(tput, result)
    c, m = result.config, result.metrics
    rate = "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}/s"
    fig.suptitle(
        f"{c.model} via {c.endpoint}: {c.workload}, {result.num_sessions} prompts, rate {rate}, "
        f"max concurrency {c.max_concurrency or '-'}; {m.completed} ok, {m.failed} failed"
    )
    fig.savefig(path, dpi=100)


def _distribution(ax: Axes, series: dict[str, list[float]], xlabel: str) -> None:
    """Histograms (left axis, counts) and CDFs (right axis) of each series, in ms."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests / gaps")
    if not any(series.values()):
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        return
    cdf = ax.twinx()
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("CDF")
    for (name, seconds), color in zip(series.items(), ("tab:blue", "tab:orange"), strict=False):
        if not seconds:
            continue
        ms = np.sort(np.asarray(seconds) * 1000)
        ax.hist(ms, bins=min(50, max(5, len(ms) // 4)), alpha=0.5, color=color, label=name)
        cdf.plot(ms, np.arange(1, len(ms) + 1) / len(ms), color=color, linewidth=1.5)
        ax.axvline(float(np.percentile(ms, 99)), color=color, linestyle=":", linewidth=1)
    ax.legend(loc="center right", title="dotted: p99")


def _throughput(ax: Axes, result: ServeResult) -> None:
    per_s = result.metrics.output_tokens_per_s
    starts = np.arange(len(per_s)) * THROUGHPUT_BIN_S
    ax.bar(starts, per_s, width=THROUGHPUT_BIN_S, align="edge", color="tab:green", alpha=0.7)
    ax.axhline(result.metrics.output_throughput, color="black", linestyle="--", linewidth=1, label="mean")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"output tokens/s ({THROUGHPUT_BIN_S:g} s bins)")
    ax.legend(loc="upper right")
