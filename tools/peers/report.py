"""The report of `python tools/peers`: targets met or not, figures, peers.md / peers.json / peers.png.

Everything here reads the report dict exactly as peers.json holds it, so a report can be
rendered again from the JSON alone (`python tools/peers --render-only`).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers import LABELS, PEERS

CLIENT_AGREEMENT = 0.05  # `kvserve bench serve` and bench_client.py within 5% of each other

Results = dict[tuple[str, str], dict[str, Any]]  # (engine, run) -> the run's JSON, successful runs only


@dataclass(frozen=True)
class Metric:
    run: str
    key: str  # dotted path into the run's JSON
    name: str
    unit: str
    scale: float = 1.0  # JSON value -> unit
    digits: int = 1

    def format(self, value: float | None) -> str:
        return "-" if value is None else f"{value * self.scale:.{self.digits}f}"


@dataclass(frozen=True)
class Target:
    title: str  # {c}: the run's concurrency (8 by default, as the targets assume)
    metric: Metric
    peer: str  # whose figure the bound is against
    bound: float  # on kvserve / peer
    higher_is_better: bool

    @property
    def goal(self) -> str:
        return f"kvserve/{LABELS[self.peer]} {'>=' if self.higher_is_better else '<='} {self.bound:g}"

    def met(self, ratio: float | None) -> bool | None:
        if ratio is None:
            return None
        return ratio >= self.bound if self.higher_is_better else ratio <= self.bound


OFFLINE_RANDOM = Metric("offline-random", "output_tok_per_s", "output tok/s", "tok/s")
OFFLINE_SHAREGPT = Metric("offline-sharegpt", "output_tok_per_s", "output tok/s", "tok/s")
SERVE_TPUT = Metric("serve-c8", "output_tok_per_s", "output tok/s", "tok/s")
SERVE_TTFT = Metric("serve-c8", "ttft_p50_s", "TTFT p50", "s", digits=3)
SINGLE_TPOT = Metric("serve-c1", "tpot_mean_s", "TPOT mean", "ms", scale=1000)
ROUND2_TTFT = Metric("shared-prefix", "round2.ttft_mean_s", "round-2 TTFT mean", "s", digits=3)

TARGETS = (
    Target("offline, random", OFFLINE_RANDOM, "vllm", 1.2, True),
    Target("offline, ShareGPT", OFFLINE_SHAREGPT, "vllm", 1.2, True),
    Target("serving c={c}", SERVE_TPUT, "vllm", 1.2, True),
    Target("serving c={c}", SERVE_TTFT, "vllm", 1.0, False),
    Target("single stream", SINGLE_TPOT, "llama", 0.8, False),
    Target("shared prefix c={c}", ROUND2_TTFT, "vllm", 0.5, False),
)

# the chart: (group label, output tok/s metric, TTFT p50 metric)
CHART_GROUPS = (
    ("offline random", OFFLINE_RANDOM, None),
    ("offline ShareGPT", OFFLINE_SHAREGPT, None),
    ("serve c=8", SERVE_TPUT, SERVE_TTFT),
    ("serve c=1", Metric("serve-c1", "output_tok_per_s", "", ""), Metric("serve-c1", "ttft_p50_s", "", "")),
    ("shared-prefix r1", Metric("shared-prefix", "round1.output_tok_per_s", "", ""),
     Metric("shared-prefix", "round1.ttft_p50_s", "", "")),
    ("shared-prefix r2", Metric("shared-prefix", "round2.output_tok_per_s", "", ""),
     Metric("shared-prefix", "round2.ttft_p50_s", "", "")),
)  # fmt: skip


# --- looking figures up -------------------------------------------------------------------------


def successful_results(report: dict[str, Any], round_: int | None = None) -> Results:
    """One round's runs (None: every round's, a later one's replacing an earlier one's: the last)."""
    return {
        (r["engine"], r["run"]): r["result"]
        for r in report["runs"]
        if r["ok"] and r["result"] is not None and round_ in (None, r.get("round", 0))
    }


def rounds(report: dict[str, Any]) -> list[Results]:
    """Each round's results (`--repeat`), in order; one for a report without rounds."""
    n = 1 + max((r.get("round", 0) for r in report["runs"]), default=0)
    return [successful_results(report, i) for i in range(n)]


def dig(results: Results, engine: str, run: str, key: str) -> Any:
    """The value at dotted `key` in the run's JSON, or None."""
    value: Any = results.get((engine, run))
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def lookup(results: Results, engine: str, metric: Metric) -> float | None:
    value = dig(results, engine, metric.run, metric.key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


@dataclass
class TargetRow:
    target: Target
    values: dict[str, float | None]  # engine -> figure (the median over rounds)
    ratios: dict[str, float | None]  # peer -> kvserve / peer (the median of the rounds' ratios)
    round_ratios: dict[str, list[float | None]]  # peer -> each round's ratio

    @property
    def met(self) -> bool | None:
        return self.target.met(self.ratios.get(self.target.peer))


def target_rows(results: list[Results], peers: tuple[str, ...] = PEERS) -> list[TargetRow]:
    """Per round, kvserve's figure over each peer's from the same round (so a machine slower in
    one round moves both), then the median of those ratios."""
    rows = []
    for target in TARGETS:
        per_round = [{e: lookup(r, e, target.metric) for e in ("kvserve", *peers)} for r in results]
        values = {e: median([v[e] for v in per_round]) for e in ("kvserve", *peers)}
        round_ratios = {p: [ratio(v["kvserve"], v[p]) for v in per_round] for p in peers}
        ratios = {p: median(round_ratios[p]) for p in peers}
        rows.append(TargetRow(target, values, ratios, round_ratios))
    return rows


# --- markdown -----------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def status(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "n/a"}[met]


def render_markdown(report: dict[str, Any]) -> str:
    results = successful_results(report)
    peers = report_peers(report)
    sections = [
        header_lines(report),
        targets_section(rounds(report), peers, report["config"]["concurrency"]),
        offline_section(report, results),
        serving_section(results),
        shared_prefix_section(results),
        client_check_section(results),
        roofline_section(results),
        problems_section(report),
    ]
    return "\n".join(line for section in sections for line in [*section, ""]).rstrip() + "\n"


def report_peers(report: dict[str, Any]) -> tuple[str, ...]:
    """The peers this report was asked for, installed or not: a missing one still gets its column."""
    return tuple(e["name"] for e in report["engines"] if e["name"] in PEERS)


def kvserve_dtype(results: Results) -> str:
    """kvserve's dtype, and its device where that was not the CPU (a GPU run)."""
    for run, prefix in (("offline-random", ""), ("step", "roofline.")):
        if value := dig(results, "kvserve", run, prefix + "dtype"):
            device = dig(results, "kvserve", run, prefix + "device")
            return f"{value} on {device}" if device and device != "cpu" else str(value)
    return "dtype not reported"


def header_lines(report: dict[str, Any]) -> list[str]:
    m, c = report["machine"], report["config"]
    engines = "; ".join(
        f"{e['label']} {e['version']}".strip() if e["installed"] else f"{e['label']}: {e['note']}"
        for e in report["engines"]
    )
    kvserve_model = c.get("model") or "smollm2-135m (default)"
    vllm_dtype = {"bfloat16": "bf16", "float32": "fp32"}[c.get("vllm_dtype", "bfloat16")]
    n = c["num_prompts_sharegpt"]
    sharegpt = f"ShareGPT {n} requests, the same token ids for kvserve and vLLM" if n > 0 else "no ShareGPT run"
    return [
        "# kvserve vs its peers",
        "",
        f"Measured {report['date']} on {m['cpu']}, {m['cores']} cores, one engine at a time, "
        f"by `python tools/peers`. Model: SmolLM2-135M-Instruct (kvserve: {kvserve_model}, "
        f"{kvserve_dtype(successful_results(report))}; vLLM {vllm_dtype}; llama-server BF16 GGUF).",
        "",
        f"Engines: {engines}.",
        "",
        f"Offline: random {c['num_prompts']} prompts x {c['input_len']} tokens -> {c['output_len']} "
        f"(ignore_eos); {sharegpt}. "
        f"Serving (`bench_client.py`, every server): random {c['num_requests']} requests x {c['input_words']} words "
        f"-> {c['max_tokens']} tokens at c={c['concurrency']} and c=1; shared-prefix {c['conversations']} "
        f"conversations, {c['system_words']}-word system prompt, c={c['concurrency']}.",
    ]


def targets_section(results: list[Results], peers: tuple[str, ...], concurrency: int) -> list[str]:
    header = ["target", "metric", "kvserve", *(LABELS[p] for p in peers)]
    header += [f"kvserve/{LABELS[p]}" for p in peers] + ["goal", "status"]
    several = len(results) > 1
    header += [f"each round, kvserve/{LABELS[p]}" for p in peers] if several else []
    rows = []
    for row in target_rows(results, peers):
        metric = row.target.metric
        figures = [metric.format(row.values[e]) for e in ("kvserve", *peers)]
        ratios = [_ratio(row.ratios[p]) for p in peers]
        goal = row.target.goal if row.target.peer in peers else f"{row.target.goal} (not run)"
        name = metric.name if metric.unit in metric.name else f"{metric.name} ({metric.unit})"
        each = [" / ".join(_ratio(r) for r in row.round_ratios[p]) for p in peers] if several else []
        rows.append([row.target.title.format(c=concurrency), name, *figures, *ratios, goal, status(row.met), *each])
    lines = ["## Targets", ""]
    if several:
        lines += [
            f"{len(results)} rounds, the engines' order reversed every other round; figures and ratios are "
            "medians over the rounds (a ratio is taken within each round); the tables below are the last round's.",
            "",
        ]
    return lines + table(header, rows)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def engines_with(results: Results, run: str) -> list[str]:
    return [e for e in LABELS if (e, run) in results]


def fmt(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    return f"{value * scale:.{digits}f}" if isinstance(value, int | float) else "-"


def offline_section(report: dict[str, Any], results: Results) -> list[str]:
    rows = [
        [LABELS[e], workload, fmt(results[e, run].get("output_tok_per_s")), fmt(results[e, run].get("total_tok_per_s"))]
        for run, workload in (("offline-random", "random"), ("offline-sharegpt", "ShareGPT"))
        for e in engines_with(results, run)
    ]
    if not rows:
        return []
    lines = ["## Offline throughput", "", *table(["engine", "workload", "output tok/s", "total tok/s"], rows)]
    return lines + same_requests_lines(report, results)


def same_requests_lines(report: dict[str, Any], results: Results) -> list[str]:
    """Both engines' ShareGPT runs should report the token totals of the one sample."""
    sample = report.get("sharegpt_requests")
    if not sample:
        return []
    want = (sample["input_tokens"], sample["output_tokens"])
    checks = [
        f"{LABELS[e]} {'the same' if (r.get('input_tokens'), r.get('output_tokens')) == want else '**different**'}"
        for e in engines_with(results, "offline-sharegpt")
        for r in [results[e, "offline-sharegpt"]]
    ]
    return [
        "",
        f"ShareGPT sample: {sample['num_requests']} requests, {want[0]} prompt tokens, {want[1]} output tokens; "
        f"token totals of each run: {', '.join(checks) or 'no run'}.",
    ]


def serving_section(results: Results) -> list[str]:
    header = ["engine", "concurrency", "output tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT mean ms", "errors", "short"]
    rows = [
        [LABELS[e], str(r.get("concurrency")), fmt(r.get("output_tok_per_s")), fmt(r.get("ttft_p50_s"), 3),
         fmt(r.get("ttft_p99_s"), 3), fmt(r.get("tpot_mean_s"), 1, 1000), str(r.get("num_errors")),
         str(r.get("short_outputs"))]
        for run in ("serve-c8", "serve-c1")
        for e in engines_with(results, run)
        for r in [results[e, run]]
    ]  # fmt: skip
    return ["## Serving, bench_client.py random", "", *table(header, rows)] if rows else []


def shared_prefix_section(results: Results) -> list[str]:
    header = ["engine", "R1 TTFT mean s", "R1 TTFT p50 s", "R2 TTFT mean s", "R2 TTFT p50 s", "R2 cached / prompt tok"]
    rows = []
    for e in engines_with(results, "shared-prefix"):
        r1, r2 = results[e, "shared-prefix"]["round1"], results[e, "shared-prefix"]["round2"]
        cached = f"{fmt(r2.get('mean_cached_prompt_tokens'), 0)} / {fmt(r2.get('mean_prompt_tokens'), 0)}"
        ttfts = [fmt(r.get(k), 3) for r in (r1, r2) for k in ("ttft_mean_s", "ttft_p50_s")]
        rows.append([LABELS[e], *ttfts, cached])
    return ["## Shared prefix, bench_client.py", "", *table(header, rows)] if rows else []


def client_check_section(results: Results) -> list[str]:
    """`kvserve bench serve` and bench_client.py on the same sizes against kvserve: do the clients agree?

    Each client ran `client_check_runs` times, in turn, each run with `client_check_requests`
    prompts of its own; their medians are compared. Runs of 32 requests were not enough: at
    c=8 their requests arrive in waves of 8 that share steps, so a run's TTFT p50 rests on four
    waves, and moved by up to ~15% from run to run.
    """
    ours, theirs = kvserve_runs(results, "bench-serve-c8-check"), kvserve_runs(results, "serve-c8-check")
    if not ours or not theirs:
        return []
    metrics = {  # name: (kvserve bench serve's values, bench_client.py's, digits)
        "output tok/s": ([r.get("output_throughput") for r in ours], [r.get("output_tok_per_s") for r in theirs], 1),
        "TTFT p50 s": (
            [r["median_ttft_ms"] / 1000 if "median_ttft_ms" in r else None for r in ours],
            [r.get("ttft_p50_s") for r in theirs],
            3,
        ),
    }
    rows = []
    for name, (a, b, digits) in metrics.items():
        r = ratio(median(a), median(b))
        agree = "-" if r is None else ("yes" if abs(r - 1) <= CLIENT_AGREEMENT else "**no**")
        runs = [" / ".join(fmt(v, digits) for v in values) for values in (a, b)]
        medians = [fmt(median(values), digits) for values in (a, b)]
        rows.append([name, *runs, *medians, "-" if r is None else f"{r:.3f}", agree])
    header = ["metric", "kvserve bench serve, runs", "bench_client.py, runs", "median, bench serve",
              "median, bench_client.py", "ratio of medians", f"within {CLIENT_AGREEMENT:.0%}"]  # fmt: skip
    return ["## Client cross-check (kvserve, random, c=8)", "", *table(header, rows)]


def kvserve_runs(results: Results, prefix: str) -> list[dict[str, Any]]:
    """kvserve's successful runs named `prefix` or `prefix-...`, in name order."""
    return [results[key] for key in sorted(results) if key[0] == "kvserve" and key[1].startswith(prefix)]


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def roofline_section(results: Results) -> list[str]:
    step = results.get(("kvserve", "step"))
    if not step:
        return []
    limits = step["roofline"]
    header = ["batch", "step ms", "tok/s", "matmul GFLOP/s", "of matmul limit", "weights GB/s", "KV GB/s",
              "of bandwidth limit"]  # fmt: skip
    rows = [
        [str(s["batch_size"]), fmt(s["step_ms"], 2), fmt(s["tok_per_s"]), fmt(s["gflops"]),
         f"{s['matmul_limit_share']:.0%}", fmt(s["weight_gb_per_s"]),
         fmt(s["kv_gb_per_s"]), f"{s['bandwidth_limit_share']:.0%}"]
        for s in step["steps"]
    ]  # fmt: skip
    return [
        "## Roofline, kvserve bench step",
        "",
        f"Measured limits ({limits['dtype']}): matmul {limits['matmul_gflops']:.0f} GFLOP/s, "
        f"memory read {limits['read_gb_per_s']:.1f} GB/s.",
        "",
        *table(header, rows),
    ]


def problems_section(report: dict[str, Any]) -> list[str]:
    notes = [f"- {e['label']}: {e['note']}" for e in report["engines"] if not e["installed"]]
    notes += [f"- {LABELS[r['engine']]} {r['run']}: {one_line(r['error'])}" for r in report["runs"] if not r["ok"]]
    return ["## Notes", "", *notes] if notes else []


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# --- chart --------------------------------------------------------------------------------------


def chart_series(results: Results, which: int) -> tuple[list[str], dict[str, list[float]]]:
    """Groups with at least one figure, and per engine its figure in each (NaN, no bar, where it has none).

    which: 1 for output tok/s, 2 for TTFT p50.
    """
    groups = [(g[0], g[which]) for g in CHART_GROUPS if g[which] is not None]
    values = {e: [lookup(results, e, m) for _, m in groups] for e in LABELS}  # type: ignore[arg-type]
    keep = [i for i in range(len(groups)) if any(v[i] is not None for v in values.values())]
    engines = {e: [nan_if_none(v[i]) for i in keep] for e, v in values.items() if any(v[i] is not None for i in keep)}
    return [groups[i][0] for i in keep], engines


def nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def plot_report(report: dict[str, Any], path: Path) -> None:
    # a Figure on an Agg canvas, not pyplot: no global backend state (as kvserve.bench.serve_plot)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = successful_results(report)
    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, which, ylabel in zip(fig.subplots(1, 2), (1, 2), ("output tokens/s", "TTFT p50 (s)"), strict=True):
        groups, engines = chart_series(results, which)
        bar_chart(ax, groups, engines, ylabel)
    fig.suptitle(f"kvserve vs peers, {report['machine']['cpu']} ({report['machine']['cores']} cores), {report['date']}")
    fig.savefig(path, dpi=100)


def bar_chart(ax: Any, groups: list[str], engines: dict[str, list[float]], ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    if not groups:
        ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
        return
    width = 0.8 / len(engines)
    for i, (engine, values) in enumerate(engines.items()):
        xs = [g + (i - (len(engines) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=LABELS[engine])
        ax.bar_label(bars, labels=["" if math.isnan(v) else f"{v:.3g}" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), groups, rotation=15)
    ax.legend()


# --- files --------------------------------------------------------------------------------------


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "peers.md").write_text(render_markdown(report))
    plot_report(report, out / "peers.png")
