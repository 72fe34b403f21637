"""Helpers for the server tests: an in-process server on a free port, metrics parsing, key files.

No tests here; the `test_server_*.py` modules import from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.entrypoints.cli import build_parser
from kvserve.server.api_server import create_server

TINY_ARGS = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
KEYS = {"key-a": "A", "key-b": "B"}


class ServerThread:
    """`kvserve serve` in a thread of this process, on a free port (``with`` starts and stops it)."""

    def __init__(self, model: Path | str, *args: str):
        parsed = build_parser().parse_args(["serve", "--model", str(model), "--port", "0", *args])
        self.server = create_server(parsed)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = ""

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.server.config.app.state.engine

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class Hold:
    """An `on_step` hook that holds the engine thread once, after the first step where `ready()` holds,
    until `release` is set: what is read meanwhile (/metrics, /load, /debug/kv_state) sees one moment."""

    def __init__(self, ready: Callable[[], bool], timeout: float = 120):
        self.ready, self.timeout = ready, timeout
        self.held, self.release = threading.Event(), threading.Event()

    def __call__(self, outputs: object) -> None:
        if not self.held.is_set() and self.ready():
            self.held.set()
            self.release.wait(self.timeout)


def complete(server: ServerThread, key: str, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def run_in_threads(server: ServerThread, requests: list[tuple[str, dict]]) -> list[threading.Thread]:
    """`complete` each (key, body) in a thread of its own, started."""
    threads = [threading.Thread(target=complete, args=(server, key), kwargs=body) for key, body in requests]
    for t in threads:
        t.start()
    return threads


def write_keys(path: Path, keys: dict[str, str] = KEYS) -> Path:
    lines = ["# key tenant", ""] + [f"{k} {t}" for k, t in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of /metrics by (name, labels)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_idle(url: str, timeout: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Wait until no request runs or waits and no KV block is in use; returns the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = [
            m[("kvserve:" + k, ())] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        if not any(busy):
            return m
        assert time.monotonic() < deadline, f"still busy: running, waiting, kv usage = {busy}"
        time.sleep(0.05)


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of a response, checking its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err
