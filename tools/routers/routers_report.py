"""The report of `python tools/routers`: routers.json, and routers.md made from it alone (--render-only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KVSERVE = "cache_aware"
# what the decision measure's block keys were hashed with (reports from before it was recorded say nothing)
HASHED = {
    "C": ", block keys hashed in C",
    "Python": ", block keys hashed in Python (the C extension is not built here)",
}


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None  # None: a run it needs failed or did not run
    goal: float
    at_most: bool  # the value must be <= goal (else >=)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.goal if self.at_most else self.value >= self.goal


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def plain_runs(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """policy -> its successful run without a variant (tiers off, nothing killed)."""
    return {r["policy"]: r for r in report["runs"] if r["ok"] and not r["variant"]}


def variant_run(report: dict[str, Any], variant: str) -> dict[str, Any] | None:
    return next((r for r in report["runs"] if r["variant"] == variant), None)


def targets(report: dict[str, Any]) -> list[Target]:
    runs = plain_runs(report)
    ours = runs.get(KVSERVE, {})

    def vs(peer: str, key: str) -> float | None:
        return ratio(ours.get(key), runs.get(peer, {}).get(key))

    kill = variant_run(report, "kill")
    lost = kill["failed"] + kill["unsent"] if kill and kill["ok"] else None
    p99 = report.get("decision", {}).get("hash_and_decision", {}).get("p99_ms")  # wall clock, preemption included
    return [
        Target("hit rate, cache_aware / round_robin", vs("round_robin", "hit_rate"), 2.0, False),
        Target("hit rate, cache_aware / sglang-router", vs("sglang", "hit_rate"), 1.2, False),
        Target("TTFT p50, cache_aware / round_robin", vs("round_robin", "ttft_p50_ms"), 0.5, True),
        Target("TTFT p50, cache_aware / sglang-router", vs("sglang", "ttft_p50_ms"), 0.8, True),
        Target("routing decision p99, 8k tokens, hashing included (ms)", p99, 1.0, True),
        Target("requests lost when a replica is SIGKILLed mid-run", lost, 0, True),
    ]


def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _load(run: dict[str, Any]) -> str:
    return f"{run['load_before'][0]:.1f} → {run['load_after'][0]:.1f}"


def _label(run: dict[str, Any]) -> str:
    return run["label"] + (f" ({run['variant']})" if run["variant"] else "")


def system_lines(report: dict[str, Any]) -> list[str]:
    """What the "(system)" rows ran (tools/routers/system_prompt.py), where they ran."""
    run = next((r for r in report["runs"] if r["variant"] == "system" and "system_tokens" in r), None)
    if run is None:
        return []
    return [
        "",
        f'Rows "(system)": the same chats, each opening with one shared {run["system_tokens"]}-token system '
        f"prompt, dealt out over {run['tenants']} tenants' API keys (the same text salted apart per tenant); "
        f"device pool {run['pool_tokens']} tokens each (each tenant's system prompt added to the working set "
        "once); bound: a later turn reuses its previous turn, a tenant's later chat its system prompt.",
    ]


def results_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| router / policy | hit rate (bound) | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | completed "
        "| failed + unsent | added latency p50 (ms) | load 1 min (before → after) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in report["runs"]:
        label = _label(run)
        if not run["ok"]:
            lines.append(f"| {label} | failed: see notes | | | | | | | {_load(run)} |")
            continue
        added = run.get("added_latency", {}).get("added_p50_ms")
        lines.append(
            f"| {label} | {run['hit_rate']:.1%} ({_pct(run.get('reuse_bound'))}) "
            f"| {run['ttft_p50_ms']:.0f} | {run['ttft_p90_ms']:.0f} "
            f"| {run['output_throughput']:.1f} | {run['completed']} | {run['failed']} + {run['unsent']} "
            f"| {_f(added, 1)} | {_load(run)} |"
        )
    return lines


def targets_table(report: dict[str, Any]) -> list[str]:
    lines = ["| target | goal | measured | met |", "| --- | ---: | ---: | --- |"]
    for t in targets(report):
        goal = ("<= " if t.at_most else ">= ") + f"{t.goal:g}"
        met = {True: "yes", False: "**no**", None: "n/a"}[t.met]
        lines.append(f"| {t.name} | {goal} | {_f(t.value, 3)} | {met} |")
    return lines


def decision_lines(report: dict[str, Any]) -> list[str]:
    d = report.get("decision")
    if not d:
        return ["(not measured)"]
    row = lambda name, s: f"| {name} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['max_ms']:.3f} |"  # noqa: E731
    return [
        f"In process, {d['prompt_tokens']}-token prompt, block size {d['block_size']}, two replicas whose "
        f"indexes hold all of it / half of it, {d['reps']} repetitions (load {d['load'][0]:.2f})"
        f"{HASHED.get(d.get('hashed_in'), '')}:",
        "",
        "| step | p50 (ms) | p99 (ms) | max (ms) |",
        "| --- | ---: | ---: | ---: |",
        row("block keys (hashing) + cache_aware decision", d["hash_and_decision"]),
        *(
            [row("block keys + decision, this thread's CPU time", d["hash_and_decision_cpu"])]
            if "hash_and_decision_cpu" in d
            else []
        ),
        row("cache_aware decision alone", d["decision_only"]),
        row(f"tokenization alone ({d['tokenize']['reps']} reps; reported apart)", d["tokenize"]),
    ]


def histogram_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for run in report["runs"]:
        h = run.get("router_histograms")
        if not h:
            continue
        label = _label(run)
        dec, tok = h.get("decision", {}), h.get("tokenize", {})
        lines.append(
            f"- {label}: decision mean {_f(dec.get('mean_ms'), 3)} ms, p99 <= {_f(dec.get('p99_le_ms'), 1)} ms; "
            f"tokenize + hash mean {_f(tok.get('mean_ms'), 3)} ms, p99 <= {_f(tok.get('p99_le_ms'), 1)} ms "
            f"({dec.get('count', 0):.0f} requests)"
        )
    return lines or ["(no kvserve router run)"]


def _pair(counters: list[dict[str, float]], figure) -> str:
    return " / ".join(f"{figure(c):.0f}" if c else "-" for c in counters)


def split_table(report: dict[str, Any]) -> list[str]:
    """Where the CPU went during each benchmark and how the router split the requests over the replicas."""
    lines = [
        "| router / policy | CPU s: router | replica 0 | replica 1 | requests 0 / 1 | prefill computed 0 / 1 "
        "| generated 0 / 1 | preemptions 0 / 1 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in report["runs"]:
        cpu, counters = run.get("cpu_s"), run.get("replica_counters")
        if not cpu or not counters or len(counters) != 2:
            continue
        lines.append(
            f"| {_label(run)} | {_f(cpu.get('router'), 1)} | {_f(cpu.get('replica 0'), 1)} "
            f"| {_f(cpu.get('replica 1'), 1)} | {_pair(counters, lambda c: c['request_success'])} "
            f"| {_pair(counters, lambda c: c['prompt_tokens'] - c['prefix_cache_hits'])} "
            f"| {_pair(counters, lambda c: c['generation_tokens'])} "
            f"| {_pair(counters, lambda c: c['num_preemptions'])} |"
        )
    return lines if len(lines) > 2 else ["(not measured)"]


def notes(report: dict[str, Any]) -> list[str]:
    out = []
    for run in report["runs"]:
        label = _label(run)
        if not run["ok"]:
            out.append(f"- **{label} failed**: `{run.get('error', '')[-800:]}`")
        for error, n in (run.get("errors") or {}).items():
            out.append(f"- {label}: {n} x `{error}`")
        lat = run.get("added_latency") or {}
        if lat.get("failed"):
            out.append(f"- {label}: {lat['failed']} latency probes failed, e.g. `{lat['errors'][:1]}`")
        if run["variant"] == "kill" and run.get("killed_at_s") is not None:
            out.append(f"- {label}: replica 1 SIGKILLed {run['killed_at_s']:.0f} s into the run")
    return out or ["- none"]


def render(report: dict[str, Any]) -> str:
    s, m = report["sizing"], report["machine"]
    cfg = report["config"]
    head = [
        "# Routers: kvserve's against round-robin, least-loaded, sglang-router and vllm-router",
        "",
        f"Run {report['date']} on {m['cpu']} ({m['cpus']} CPUs), one core per replica; `{report['command']}`.",
        "",
        f"Workload: `kvserve bench serve --workload multiturn --endpoint chat`, {s['conversations']} ShareGPT chats, "
        f"{s['turns']} user turns in all (at most {cfg['turns']} each), {cfg['concurrency']} chats in flight, "
        f"replies as ShareGPT's (<= 128 tokens). Two `kvserve serve` replicas (SmolLM2-135M), restarted empty for "
        f"every run; device pool {s['pool_tokens']} tokens each ({s['pool_bytes']} bytes), the chats' working set "
        f"~{s['working_set_tokens']} tokens = {s['working_set_ratio']}x one pool; disk tier off; the tiers-on run "
        f"adds a {s['host_tier_bytes']} byte host tier to each. Hit rate: engine-reported cached / prompt tokens.",
        *system_lines(report),
        "",
        "## Targets",
        "",
        *targets_table(report),
        "",
        "## Results",
        "",
        *results_table(report),
        "",
        "Bound: the hit rate a perfect router could reach on the same turns (each turn's prompt less the "
        "previous turn's prompt and reply is new text no cache holds; a turn's own retokenized reply makes it "
        "approximate). Added latency: median of max_tokens=1 completions straight to the replicas (in turn) "
        "and through the router, "
        "interleaved, before the benchmark (replicas idle). Load: `os.getloadavg()` before and after each run "
        "(the machine is shared).",
        "",
        "## Work split",
        "",
        "CPU seconds each process used during the benchmark (`/proc`), and each replica's own counters "
        "(its /metrics: finished requests, prompt tokens less prefix-cache hits, generated tokens, preemptions; "
        "the added-latency probes included).",
        "",
        *split_table(report),
        "",
        "## Routing decision",
        "",
        *decision_lines(report),
        "",
        "kvserve router's own histograms over the benchmark's requests (short chat prompts):",
        "",
        *histogram_lines(report),
        "",
        "## Notes",
        "",
        *notes(report),
        "",
    ]
    return "\n".join(head)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(render(report))
