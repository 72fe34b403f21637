"""`kvserve serve --replicas 2`: two tiny-model replicas on disjoint cores behind a router, one command;
a completion through it, and after Ctrl-C no process left."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from test_server_common import TINY_ARGS, write_keys

from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.cluster import Replica, core_groups, free_port, replica_flags, router_args, serve_parser


def test_replica_flags_are_the_users_minus_the_clusters_own():
    argv = ["serve", "m", "--replicas", "2", "--port", "9", "--dtype", "float32", "--no-enable-prefix-caching"]
    args = build_parser().parse_args(
        [*argv, "--strict-fields", "--cache-secret", "s", "--max-num-batched-tokens", "512"]
    )
    args.model = args.model_tag
    flags = replica_flags(args, serve_parser())
    assert flags == ["--model", "m", "--dtype", "float32", "--no-enable-prefix-caching", "--strict-fields"]


def test_max_local_prefill_tokens_goes_to_the_router_not_the_replicas():
    argv = ["serve", "m", "--replicas", "2", "--pd", "--max-local-prefill-tokens", "64", "--dtype", "float32"]
    args = build_parser().parse_args(argv)
    args.model = args.model_tag
    assert replica_flags(args, serve_parser()) == ["--model", "m", "--dtype", "float32"]
    prefill = Replica(0, [0], [], "http://127.0.0.1:1", role="prefill")
    replicas = [prefill, Replica(1, [1], [], "http://127.0.0.1:2", role="decode")]
    router = router_args(args, replicas, "secret")
    assert router.max_local_prefill_tokens == 64
    assert (router.prefill, router.decode) == (["http://127.0.0.1:1"], ["http://127.0.0.1:2"])


def test_core_groups_are_disjoint_and_cover_the_cores():
    groups = core_groups(2)
    assert len(groups) == 2 and all(groups)
    assert not set(groups[0]) & set(groups[1])


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def _router_line(lines: queue.Queue, proc: subprocess.Popen, log, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}: {open(log.name).read()[-3000:]}"
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line.startswith("kvserve: router on"):
            return line
    raise AssertionError(f"no router URL: {open(log.name).read()[-3000:]}")


@pytest.mark.parametrize("pd", [False, True], ids=["both", "pd"])
def test_serve_replicas_starts_routes_and_stops_everything(tiny_model_dir, tmp_path, pd):
    keys, port = write_keys(tmp_path / "keys"), free_port()
    cmd = [sys.executable, "-m", "kvserve", "serve", str(tiny_model_dir), "--replicas", "2", "--port", str(port)]
    cmd += [*TINY_ARGS, "--api-keys", str(keys), *(["--pd"] if pd else [])]
    log = (tmp_path / "cluster.log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        line = _router_line(lines, proc, log)
        url = f"http://127.0.0.1:{port}"
        assert url in line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 2
        assert not set(children[0].cpu_affinity()) & set(children[1].cpu_affinity())
        auth = {"Authorization": "Bearer key-a"}
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/health").status_code != 200:  # until the router has discovered a replica
            assert time.monotonic() < deadline, "the router found no replica"
            time.sleep(0.1)
        body = {"model": str(tiny_model_dir), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        replicas = httpx.get(f"{url}/router/replicas", headers=auth).json()
        assert len(replicas) == 2 and all(r["url"] in line for r in replicas)
        assert all(r["events"] is not None for r in replicas)  # the router has the replicas' secret: it follows events
        roles = [httpx.get(f"{r['url']}/server_info").json()["role"] for r in replicas]
        assert sorted(roles) == (["decode", "prefill"] if pd else ["both", "both"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=45) == 0
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
