"""/metrics after a known set of requests: every counter equals what was sent; GET /load (the gauges a
router weighs) equals /metrics' while the engine is held with requests running, and is what the
router's view of the replica is made of."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from test_server_common import TINY_ARGS, Hold, ServerThread, complete, metrics, run_in_threads, wait_idle, write_keys

from kvserve.logger import logger
from kvserve.router.replicas import ReplicaSet, ServerInfo, State
from kvserve.server.metrics import ServerMetrics
from kvserve.server.stats_logger import StatsLogger


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt")
    with ServerThread(tiny_model_dir, "--api-keys", str(keys), *TINY_ARGS) as s:
        yield s


def test_counters_equal_what_was_sent(server):
    shared = list(range(100, 140))  # 40 tokens: two whole blocks can be reused
    sent = [
        ("key-a", dict(prompt=shared, max_tokens=5, ignore_eos=True, temperature=0)),
        ("key-a", dict(prompt=shared, max_tokens=5, ignore_eos=True, temperature=0)),  # cache hit
        ("key-b", dict(prompt=shared, max_tokens=3, ignore_eos=True, temperature=0)),  # no hit: other tenant
        ("key-b", dict(prompt=list(range(7, 17)), max_tokens=2, ignore_eos=True)),
    ]
    replies = [(key, complete(server, key, **body)) for key, body in sent]
    greedy = replies[0][1]["choices"][0]["text"]
    # a stop string greedy decoding produces at once: finish reason "stop"
    stopped = complete(server, "key-a", prompt=shared, max_tokens=5, temperature=0, stop=greedy[:3])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == ""
    replies.append(("key-a", stopped))

    m = wait_idle(server.url)
    usages = [(key, r["usage"]) for key, r in replies]
    assert m[("kvserve:prompt_tokens_total", ())] == sum(u["prompt_tokens"] for _, u in usages)
    assert m[("kvserve:generation_tokens_total", ())] == sum(u["completion_tokens"] for _, u in usages)
    assert m[("kvserve:request_success_total", (("finished_reason", "length"),))] == 4
    assert m[("kvserve:request_success_total", (("finished_reason", "stop"),))] == 1
    for key, tenant in (("key-a", "A"), ("key-b", "B")):
        mine = [u for k, u in usages if k == key]
        assert m[("kvserve:tenant_requests_total", (("tenant", tenant),))] == len(mine)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in mine)
        assert m[("kvserve:tenant_cached_tokens_total", (("tenant", tenant),))] == cached
    assert m[("kvserve:tenant_cached_tokens_total", (("tenant", "A"),))] == 2 * 32
    assert m[("kvserve:tenant_cached_tokens_total", (("tenant", "B"),))] == 0
    assert m[("kvserve:prefix_cache_queries_total", ())] == sum(u["prompt_tokens"] for _, u in usages)
    assert m[("kvserve:prefix_cache_hits_total", ())] == 2 * 32
    assert m[("kvserve:num_preemptions_total", ())] == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert m[(f"kvserve:{histogram}_count", ())] == len(replies)
    tokens_after_first = sum(u["completion_tokens"] - 1 for _, u in usages)
    assert m[("kvserve:inter_token_latency_seconds_count", ())] == tokens_after_first


def test_registry_is_per_server(server):
    """Two servers in one process keep separate registries (no duplicate-metric errors)."""
    names = {name for name, _ in metrics(server.url)}
    assert "kvserve:kv_cache_usage_perc" in names
    other = ServerMetrics(server.engine)
    assert other.registry is not server.server.config.app.state.metrics.registry
    assert b"kvserve:tenant_requests_total{" not in other.render()  # no tenant has sent anything there


def test_stats_log_line_only_when_something_happened(server):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        stats_logger = StatsLogger(server.engine)
        stats_logger.log()
        assert lines == []  # idle: nothing to say
        complete(server, "key-a", prompt=[5] * 20, max_tokens=4, ignore_eos=True)
        stats_logger.log()
    finally:
        logger.removeHandler(handler)
    (line,) = lines
    assert "generation throughput" in line and "KV cache usage: 0.0%" in line and "prefix cache hit rate" in line


def test_load_equals_the_metrics_gauges_and_feeds_the_routers_view_of_the_replica(server):
    hold = Hold(lambda: len(server.engine.engine.scheduler.running) == 2)
    server.engine.on_step.append(hold)
    body = dict(max_tokens=64, ignore_eos=True, temperature=0)
    clients = run_in_threads(server, [("key-a", dict(prompt=list(range(p, p + 100)), **body)) for p in (1000, 3000)])
    try:
        assert hold.held.wait(60), "the requests never ran together"
        load = httpx.get(f"{server.url}/load").json()  # no key, as /health
        scraped = metrics(server.url)
        replicas = ReplicaSet([server.url], httpx.AsyncClient(), None)
        r = replicas.replicas[0]
        info = httpx.get(f"{server.url}/server_info").json()
        r.state, r.info = State.HEALTHY, ServerInfo.from_json(info, server.url)
        asyncio.run(replicas.read_load(r))
    finally:
        hold.release.set()
        server.engine.on_step.remove(hold)
        for t in clients:
            t.join(60)
    assert load == {g: pytest.approx(scraped[(f"kvserve:{g}", ())]) for g in load}
    assert set(load) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    assert load["num_requests_running"] == 2 and load["num_requests_waiting"] == 0
    capacity = r.info.num_kv_blocks * r.info.block_size
    assert load["kv_cache_usage_perc"] * capacity >= 2 * 100  # both prompts' blocks are held
    # none of it went through this router: all of it is the replica's other clients'
    assert (r.load.running, r.load.waiting) == (2.0, 0.0)
    assert r.load.others_tokens == pytest.approx(load["kv_cache_usage_perc"] * capacity)
