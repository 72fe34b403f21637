"""The router's /dashboard in headless Chromium: one panel per replica, each equal to that replica's
own /debug/kv_state, and the routing numbers equal to the router's /metrics."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grafana_dashboard
import httpx
import pytest
from chromium import chromium_binary, dump_dom, page_fields, screenshot
from test_server_common import TINY_ARGS, ServerThread, metrics, wait_idle, write_keys

from kvserve.entrypoints.cli import build_parser
from kvserve.router.app import create_router

KEY = "key-a"
SECRET = "dashboard-router-secret"
SCREENSHOT = os.environ.get("KVSERVE_DASHBOARD_ROUTER_SCREENSHOT")  # where to write one too


class RouterThread(ServerThread):
    """`kvserve router` in a thread of this process, on a free port."""

    def __init__(self, *args: str):
        parsed = build_parser().parse_args(["router", "--port", "0", *args])
        self.server = create_router(parsed)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-router", daemon=True)
        self.url = ""


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    keys = str(write_keys(tmp_path_factory.mktemp("keys") / "keys.txt"))
    common = ["--api-keys", keys, "--cache-secret", SECRET, "--served-model-name", "tiny", *TINY_ARGS]
    with ServerThread(tiny_model_dir, *common) as a, ServerThread(tiny_model_dir, *common) as b:
        replica_args = [arg for r in (a, b) for arg in ("--replica", r.url)]
        with RouterThread(*replica_args, "--api-keys", keys, "--cache-secret", SECRET) as router:
            yield router, [a, b]


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_router_page_has_a_panel_per_replica_equal_to_its_own_state(cluster):
    chromium_binary()
    router, replicas = cluster
    prompts = [list(range(100, 150)), list(range(300, 340)), list(range(100, 150)), list(range(300, 340))]
    for prompt in prompts:
        body = dict(prompt=prompt, max_tokens=4, ignore_eos=True, temperature=0)
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
    for r in replicas:
        wait_idle(r.url)
    url = router.url.replace("http://", f"http://viewer:{KEY}@") + "/dashboard"
    sections, _ = page_fields(dump_dom(url))
    if SCREENSHOT:
        screenshot(url, Path(SCREENSHOT), size=(1400, 1500))
    routed = metrics(router.url)
    table = sections["router"]
    assert sum(int(table[f"router.{i}.routed"]) for i in range(2)) == len(prompts)
    for i, replica in enumerate(replicas):
        label = (("replica", replica.url),)
        for field, metric in [
            ("routed", "router_requests_routed_total"),
            ("predicted_cached_tokens", "router_predicted_cached_tokens_total"),
            ("reported_cached_tokens", "router_reported_cached_tokens_total"),
        ]:
            assert table[f"router.{i}.{field}"] == str(int(routed.get((f"kvserve:{metric}", label), 0))), field
        assert table[f"router.{i}.state"] == "healthy"
        panel = sections[f"replica-{i}"]
        state = httpx.get(f"{replica.url}/debug/kv_state", headers=auth(), timeout=30).json()
        m = metrics(replica.url)
        for name in ("free", "evictable", "used", "num_blocks"):
            assert panel[f"pool.{name}"] == str(state["pool"][name]), name
        assert panel["prefix.hits"] == str(int(m[("kvserve:prefix_cache_hits_total", ())]))
        assert panel["requests.generation_tokens"] == str(int(m[("kvserve:generation_tokens_total", ())]))
        assert panel["requests.running"] == "0"


def test_router_page_and_endpoint_need_the_key(cluster):
    router, _ = cluster
    for path in ("/dashboard", "/debug/kv_state"):
        assert httpx.get(router.url + path).status_code == 401
        assert httpx.get(router.url + path, headers=auth("wrong")).status_code == 401
        assert httpx.get(router.url + path, headers=auth(), timeout=30).status_code == 200
    state = httpx.get(router.url + "/debug/kv_state", headers=auth(), timeout=30).json()
    assert state["kind"] == "router" and all(r["kv_state"]["kind"] == "replica" for r in state["replicas"])


def test_grafana_router_panels_read_only_metrics_the_router_exports(cluster):
    router, _ = cluster
    names = {n for n in grafana_dashboard.metric_names(grafana_dashboard.load()) if n.startswith("kvserve:router_")}
    exported = {name for name, _ in metrics(router.url)}  # after the first test routed requests
    assert names and names <= exported, sorted(names - exported)
