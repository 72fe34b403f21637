"""The routers harness (tools/routers): pool sizing and the report's ratios and targets (no router is started)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "routers"))  # the harness is a folder of scripts, not a package

from routers import pool_for  # noqa: E402
from routers_report import decision_lines, split_table, targets  # noqa: E402


def test_pool_holds_the_working_set_over_the_ratio_in_whole_blocks() -> None:
    pool_bytes, tokens = pool_for(11501, 2.5, 100, 16)
    assert tokens % 16 == 0
    assert tokens >= 11501 / 2.5 > tokens - 16  # the fewest whole blocks that reach working set / ratio
    assert pool_bytes == tokens * 100


def _run(policy: str, hit: float, ttft: float, variant: str = "", failed: int = 0, ok: bool = True) -> dict:
    run = {"policy": policy, "variant": variant, "label": policy, "ok": ok, "load_before": [1.0], "load_after": [2.0]}
    if ok:
        run |= {"hit_rate": hit, "ttft_p50_ms": ttft, "ttft_p90_ms": ttft, "output_throughput": 1.0}
        run |= {"completed": 10, "failed": failed, "unsent": 0, "errors": {}}
    return run


def _report(runs: list[dict]) -> dict:
    decision = {"hash_and_decision": {"p99_ms": 0.5}}
    return {"runs": runs, "decision": decision}


def test_targets_compare_cache_aware_with_round_robin_and_sglang() -> None:
    runs = [_run("round_robin", 0.3, 400), _run("sglang", 0.5, 250), _run("cache_aware", 0.6, 190)]
    runs.append(_run("cache_aware", 0.6, 300, variant="kill", failed=2))  # a variant is never the baseline
    got = {t.name: (t.value, t.met) for t in targets(_report(runs))}
    assert got["hit rate, cache_aware / round_robin"] == (2.0, True)
    assert got["hit rate, cache_aware / sglang-router"] == (1.2, True)
    assert got["TTFT p50, cache_aware / round_robin"] == (0.475, True)
    assert got["TTFT p50, cache_aware / sglang-router"] == (0.76, True)
    assert got["requests lost when a replica is SIGKILLed mid-run"] == (2, False)


def test_a_failed_peer_leaves_its_ratios_unknown_not_met() -> None:
    runs = [_run("round_robin", 0.3, 400), _run("sglang", 0, 0, ok=False), _run("cache_aware", 0.3, 500)]
    got = {t.name: t for t in targets(_report(runs))}
    assert got["hit rate, cache_aware / sglang-router"].met is None
    assert got["hit rate, cache_aware / round_robin"].met is False
    assert got["requests lost when a replica is SIGKILLed mid-run"].met is None  # the kill run did not run


def test_the_work_split_shows_each_process_cpu_and_each_replica_share() -> None:
    counters = dict(request_success=3, prompt_tokens=100, generation_tokens=40, prefix_cache_hits=60, num_preemptions=1)
    split = _run("cache_aware", 0.6, 190)
    split |= {"cpu_s": {"router": 2.5, "replica 0": 26.0, "replica 1": None}, "replica_counters": [counters, {}]}
    rows = split_table(_report([_run("sglang", 0.5, 250), split]))  # a run without the figures has no row
    assert len(rows) == 3
    assert rows[2] == "| cache_aware | 2.5 | 26.0 | n/a | 3 / - | 40 / - | 40 / - | 1 / - |"


def test_the_decision_says_whether_its_keys_were_hashed_in_c() -> None:
    """A tree without the C hashing built (a fresh clone) measures Python's, ~4x slower: the report says so."""
    timing = {"p50_ms": 0.3, "p99_ms": 0.6, "max_ms": 0.7, "reps": 30}
    decision = {"prompt_tokens": 8196, "block_size": 16, "reps": 300, "load": [0.5]}
    decision |= {"hash_and_decision": timing, "decision_only": timing, "tokenize": timing}
    python = decision_lines({"decision": {**decision, "hashed_in": "Python"}})[0]
    assert "hashed in Python (the C extension is not built here)" in python
    assert "hashed in C:" in decision_lines({"decision": {**decision, "hashed_in": "C"}})[0]
