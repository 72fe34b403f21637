"""GET /dashboard in a real headless Chromium, against GET /debug/kv_state and /metrics.

While requests run, the engine is held after a step (an `on_step` hook waits, as in
test_server_bad_input.py), so the page, the JSON and a scrape all read the same moment;
the page's numbers must equal theirs. Then the same at idle, after the requests finished.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import grafana_dashboard
import httpx
import pytest
from chromium import chromium_binary, dump_dom, page_fields, screenshot
from test_server_common import Hold, ServerThread, complete, metrics, run_in_threads, wait_idle, write_keys

from kvserve.engine.kv_state import tenant_digest
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.server.auth import cache_salt

KEYS = {"key-alice-7f3e": "tenant-alice", "key-bob-91c2": "tenant-bob"}
ALICE, BOB = "key-alice-7f3e", "key-bob-91c2"
ARGS = [
    "--served-model-name",
    "tiny-llama",
    "--dtype",
    "float32",
    "--num-kv-blocks",
    "160",
    "--max-model-len",
    "512",
    "--kv-host-memory",
    "4MiB",
]
SCREENSHOT = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT")  # also write it here (docs/dashboard.png)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt", KEYS)
    with ServerThread(tiny_model_dir, "--api-keys", str(keys), *ARGS) as s:
        yield s


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def kv_state(server: ServerThread, key: str = ALICE) -> dict:
    r = httpx.get(f"{server.url}/debug/kv_state", headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def page_url(server: ServerThread, key: str) -> str:
    """The page as a person opens it: the key as the Basic password (the browser resends it)."""
    return server.url.replace("http://", f"http://viewer:{key}@") + "/dashboard"


def running_with_a_snapshot(server: ServerThread, num_requests: int) -> Callable[[], bool]:
    """Once the requests run (3+ sequences) and a snapshot of this very step exists."""

    def ready() -> bool:
        core, latest = server.engine.engine, server.engine.kv_feed.latest
        running = len(core.output_processor.groups) == num_requests and len(core.scheduler.running) >= 3
        return running and latest is not None and latest.step == core.stats.num_steps

    return ready


def expected_digests(server: ServerThread) -> dict[str, str]:
    secret = server.server.config.app.state.openai_serving_chat._cache_secret
    return {t: tenant_digest(extra_key(cache_salt(secret, t))) for t in KEYS.values()}


def js_percent(x: float) -> str:
    """`(100 * x).toFixed(1) + "%"`, as the page writes it: JavaScript rounds a tie (11.25) up, Python to even."""
    return f"{Decimal(100 * x).quantize(Decimal('0.1'), rounding=ROUND_HALF_UP)}%"


def check_page_equals(fields: dict[str, str], body: dict[str, str], state: dict, m: dict) -> None:
    """What the page shows = the JSON = /metrics (the engine held still between the three reads)."""
    pool, prefix, req = state["pool"], state["prefix_cache"], state["requests"]
    assert body["data-step"] == str(state["step"])
    for name in ("free", "evictable", "used", "shared", "num_blocks"):
        assert fields[f"pool.{name}"] == str(pool[name]), name
    assert pool["free"] + pool["evictable"] + pool["used"] == pool["num_blocks"]
    assert fields["pool.usage"] == js_percent(m[("kvserve:kv_cache_usage_perc", ())])
    assert pool["usage"] == pytest.approx(m[("kvserve:kv_cache_usage_perc", ())])
    for field, metric in [
        ("requests.running", "num_requests_running"),
        ("requests.waiting", "num_requests_waiting"),
        ("requests.preemptions", "num_preemptions_total"),
        ("requests.generation_tokens", "generation_tokens_total"),
        ("prefix.hits", "prefix_cache_hits_total"),
        ("prefix.queries", "prefix_cache_queries_total"),
        ("prefix.evictions", "prefix_cache_evictions_total"),
        ("prefix.external_hits", "external_prefix_cache_hits_total"),
        ("latency.ttft_count", "time_to_first_token_seconds_count"),
        ("latency.itl_count", "inter_token_latency_seconds_count"),
    ]:
        assert fields[field] == str(int(m[(f"kvserve:{metric}", ())])), field
    assert fields["requests.running"] == str(req["running"]) and fields["requests.waiting"] == str(req["waiting"])
    assert fields["prefix.cached_blocks"] == str(prefix["cached_blocks"])
    assert fields["prefix.hit_rate"] == js_percent(prefix["hits"] / prefix["queries"])
    for tier in state["tiers"]:
        label = (("tier", tier["name"]),)
        assert fields[f"tier.{tier['name']}.hits"] == str(int(m[("kvserve:kv_tier_hits_total", label)]))
        assert fields[f"tier.{tier['name']}.queries"] == str(int(m[("kvserve:kv_tier_queries_total", label)]))
    shown = {k.removeprefix("tenant."): int(v) for k, v in fields.items() if k.startswith("tenant.")}
    assert shown == {t["digest"]: t["blocks"] for t in pool["tenants"]}


def assert_no_secret(text: str, server: ServerThread) -> None:
    secret = server.server.config.app.state.openai_serving_chat._cache_secret
    for tenant in KEYS.values():
        salt = cache_salt(secret, tenant)
        for leak in (tenant, salt, extra_key(salt).hex(), secret.hex()):
            assert leak not in text, "the dashboard shows a tenant's name, salt or the secret"
    for key in KEYS:
        assert key not in text, "the dashboard shows an API key"


def wait_for_snapshot_of_last_step(server: ServerThread, timeout: float = 10.0) -> None:
    """A snapshot stands for up to two capture intervals: the last steps may be newer than it."""
    steps, deadline = server.engine.engine.stats.num_steps, time.monotonic() + timeout
    while kv_state(server)["step"] != steps:
        assert time.monotonic() < deadline, "the snapshot never caught up with the engine"
        time.sleep(0.1)


def test_page_shows_what_the_endpoint_and_metrics_report(server, tmp_path):
    chromium_binary()  # skips, saying why, where Chromium is not installed
    started = time.monotonic()
    warm = [(ALICE, list(range(1000, 1100))), (BOB, list(range(2000, 2090))), (ALICE, list(range(3000, 3070)))]
    for key, prompt in warm:  # finished: their blocks stay cached (evictable), some move to the host tier
        complete(server, key, prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0)
    kv_state(server)  # someone watches: the engine takes snapshots after its steps
    shared = list(range(500, 580))
    requests = [
        (ALICE, dict(prompt=shared, max_tokens=160, ignore_eos=True, n=2, temperature=0.8, seed=1)),  # forks
        (BOB, dict(prompt=shared, max_tokens=160, ignore_eos=True, temperature=0)),
        (BOB, dict(prompt=shared + [7], max_tokens=160, ignore_eos=True, temperature=0)),  # shares BOB's prefix
    ]
    hold = Hold(running_with_a_snapshot(server, len(requests)))
    server.engine.on_step.append(hold)
    threads = run_in_threads(server, requests)
    try:
        assert hold.held.wait(60), "the requests never ran together"
        scraped, state = metrics(server.url), kv_state(server, BOB)
        dom = dump_dom(page_url(server, ALICE))
        shot = screenshot(page_url(server, ALICE), tmp_path / "dashboard.png")
        assert metrics(server.url) == scraped and kv_state(server)["step"] == state["step"], "the engine moved"
    finally:
        hold.release.set()
        server.engine.on_step.remove(hold)
        for t in threads:
            t.join(120)
    sections, body = page_fields(dom)
    fields = sections["replica"]
    check_page_equals(fields, body, state, scraped)
    pool = state["pool"]
    assert state["requests"]["running"] >= 3 and pool["used"] > 0 and pool["shared"] > 0 and pool["evictable"] > 0
    digests = expected_digests(server)
    assert {t["digest"] for t in pool["tenants"]} == set(digests.values())  # both tenants hold blocks, by digest
    assert_no_secret(dom + json.dumps(state), server)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if SCREENSHOT:
        Path(SCREENSHOT).write_bytes(shot.read_bytes())

    wait_idle(server.url)  # and at idle: every block free or cached, no request left
    wait_for_snapshot_of_last_step(server)
    idle_dom = dump_dom(page_url(server, BOB))
    scraped, state = metrics(server.url), kv_state(server)
    sections, body = page_fields(idle_dom)
    fields = sections["replica"]
    check_page_equals(fields, body, state, scraped)
    assert fields["pool.used"] == "0" and fields["requests.running"] == "0"
    assert time.monotonic() - started < 120


def test_page_shows_a_redis_cluster_tier_shard_by_shard(tiny_model_dir, tmp_path, redis_cluster):
    chromium_binary()
    keys = write_keys(tmp_path / "keys.txt", KEYS)
    remote = ["--kv-remote", redis_cluster.url(), "--cache-secret", "s"]
    with ServerThread(tiny_model_dir, "--api-keys", str(keys), *ARGS, *remote) as s:
        for seed in range(2):
            complete(s, ALICE, prompt=list(range(100 * seed, 100 * seed + 70)), max_tokens=2, temperature=0)
        redis_cluster.kill(0)  # its shard steps aside after its third failed call; the others stay
        for seed in range(2, 6):
            complete(s, ALICE, prompt=list(range(100 * seed, 100 * seed + 70)), max_tokens=2, temperature=0)
        wait_idle(s.url)
        wait_for_snapshot_of_last_step(s)
        fields = page_fields(dump_dom(page_url(s, ALICE)))[0]["replica"]
        state, scraped = kv_state(s), metrics(s.url)
    (tier,) = [t for t in state["tiers"] if t["name"] == "redis-cluster"]
    # the dead shard's breaker: open, or half-open once its 1 s cooldown passed (read at different moments)
    assert len(tier["shards"]) == 3 and [sh["breaker_state"] == 0 for sh in tier["shards"]].count(False) == 1
    for shard in tier["shards"]:
        prefix = f"tier.redis-cluster.shard.{shard['name']}"
        labels = (("shard", shard["name"]), ("tier", "redis-cluster"))
        assert fields[f"{prefix}.hits"] == str(int(scraped[("kvserve:kv_tier_shard_hits_total", labels)]))
        assert fields[f"{prefix}.queries"] == str(shard["queries"]) != "0"
        assert fields[f"{prefix}.state"] == ["ok", "stepped aside", "trying again"][shard["breaker_state"]]
        assert (shard["breaker_state"] == 0) == (scraped[("kvserve:kv_tier_shard_breaker_state", labels)] == 0)
    shard_names = {n for n in grafana_dashboard.metric_names(grafana_dashboard.load()) if "kv_tier_shard_" in n}
    assert shard_names and shard_names <= {name for name, _ in scraped}, sorted(shard_names)


def test_page_and_endpoint_need_the_key(server):
    paths = ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/debug/kv_state")
    basic = "Basic " + base64.b64encode(f"anyone:{BOB}".encode()).decode()
    for path in paths:
        for headers in ({}, auth("wrong"), {"Authorization": "Basic " + base64.b64encode(b"x:wrong").decode()}):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert r.headers["www-authenticate"].startswith("Basic "), path  # a browser asks for the key
        for headers in (auth(ALICE), {"Authorization": basic}):
            assert httpx.get(server.url + path, headers=headers, timeout=30).status_code == 200, path
    assert httpx.get(server.url + "/dashboard/keys.txt", headers=auth(ALICE)).status_code == 404


def test_page_without_the_key_shows_nothing(server):
    chromium_binary()
    sections, _ = page_fields(dump_dom(server.url + "/dashboard", budget_ms=1500))
    assert "replica" not in sections and "pool.used" not in str(sections)


def test_grafana_dashboard_reads_only_metrics_the_server_exports(server):
    complete(server, ALICE, prompt=list(range(40, 80)), max_tokens=3, ignore_eos=True)  # every histogram has samples
    names = grafana_dashboard.metric_names(grafana_dashboard.load())
    exported = {name for name, _ in metrics(server.url)}
    # the router's series come from the router, the shards' only from a cluster tier (the test below)
    replica_names = {n for n in names if not n.startswith(("kvserve:router_", "kvserve:kv_tier_shard_"))}
    assert replica_names and replica_names <= exported, sorted(replica_names - exported)
    for wanted in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "kv_tier_hits_total"):
        assert f"kvserve:{wanted}" in names  # the panels operators look at first


def test_a_stopped_engine_is_a_503(server):
    server.engine.errored = RuntimeError("stopped for this test")  # as the engine thread leaves it after a crash
    try:
        r = httpx.get(f"{server.url}/debug/kv_state", headers=auth(ALICE))
    finally:
        server.engine.errored = None
    assert r.status_code == 503 and "no KV state" in r.json()["error"]["message"]
