"""GET /load: the gauges a router weighs, equal to /metrics', and the router's view of a replica built from it.

The engine is held after a step with requests running (an `on_step` hook waits), so /load,
/metrics and the router's read all see the same moment.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from test_server_common import TINY_ARGS, ServerThread, metrics, write_keys

from kvserve.router.replicas import ReplicaSet, ServerInfo, State

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.txt")
    with ServerThread(tiny_model_dir, "--api-keys", str(keys), *TINY_ARGS) as s:
        yield s


class Hold:
    """Holds the engine thread after the first step in which `running` sequences run."""

    def __init__(self, server: ServerThread, running: int):
        self.scheduler, self.running = server.engine.engine.scheduler, running
        self.held, self.release = threading.Event(), threading.Event()

    def __call__(self, outputs: object) -> None:
        if not self.held.is_set() and len(self.scheduler.running) == self.running:
            self.held.set()
            self.release.wait(60)


def complete(server: ServerThread, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60)
    assert r.status_code == 200, r.text


def test_load_equals_the_metrics_gauges_and_feeds_the_routers_view_of_the_replica(server):
    hold = Hold(server, 2)
    server.engine.on_step.append(hold)
    clients = [threading.Thread(target=complete, args=(server, list(range(p, p + 100)))) for p in (1000, 3000)]
    for t in clients:
        t.start()
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
    assert load == {g: pytest.approx(scraped[(f"kvserve:{g}", ())]) for g in GAUGES}
    assert load["num_requests_running"] == 2 and load["num_requests_waiting"] == 0
    capacity = r.info.num_kv_blocks * r.info.block_size
    assert load["kv_cache_usage_perc"] * capacity >= 2 * 100  # both prompts' blocks are held
    # none of it went through this router: all of it is the replica's other clients'
    assert (r.load.running, r.load.waiting) == (2.0, 0.0)
    assert r.load.others_tokens == pytest.approx(load["kv_cache_usage_perc"] * capacity)
