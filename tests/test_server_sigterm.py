"""`kvserve serve` as its own process: SIGTERM lets a streaming request finish, then exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_server_common import TINY_ARGS

SHUTDOWN_TIMEOUT = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_process(tiny_model_dir, tmp_path):
    port = free_port()
    log = (tmp_path / "server.log").open("w+")
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "serve",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT),
        *TINY_ARGS,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the server exited while starting"
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def test_sigterm_drains_the_stream_then_exits_zero(server_process):
    proc, url, log = server_process
    body = {
        "prompt": "a long answer",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the request is running
        proc.send_signal(signal.SIGTERM)
        events = [line.removeprefix("data: ") for line in lines if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
    assert proc.wait(timeout=SHUTDOWN_TIMEOUT) == 0
    log.seek(0)
    output = log.read()
    assert "Waiting for connections to close" in output  # SIGTERM came while the stream ran
    assert "Application shutdown complete" in output and "Traceback" not in output
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health")
