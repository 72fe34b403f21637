"""vLLM's own router, PyPI `vllm-router` in its P/D mode (`--vllm-pd-disaggregation`), in front
of a kvserve prefill replica and a kvserve decode replica: requests succeed end to end, with the
text one plain replica gives, the decode replica computing only the prompt's last partial block,
and both replicas idle with 0 blocks in use afterwards.

vllm-router is not a dependency: `../shared/anchors/setup.sh routers` installs it under
$KVSERVE_ANCHORS (default /tmp/kvserve-anchors); without it these tests skip. What it sends was
read off the wire (vllm-router 0.1.17): the client's request with `max_tokens: 1`, `stream:
false` and `kv_transfer_params: {do_remote_decode: true, ...nulls}` to the prefill replica, then,
once that answers, the client's request with the answer's `kv_transfer_params` copied verbatim
to the decode replica, whose response (streamed or not) it relays with `usage.prompt_tokens_details
.cached_tokens` replaced by the prefill replica's. It sends `Authorization: Bearer
$OPENAI_API_KEY` (its own environment) to both, never the client's header.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_pd_disaggregation import BLOCK, SECRET, request_body, text_of
from tests.test_server_common import TINY_ARGS, ServerThread, metrics, wait_idle, write_keys

ANCHORS = Path(os.environ.get("KVSERVE_ANCHORS", "/tmp/kvserve-anchors"))
VLLM_ROUTER = ANCHORS / "router-venv" / "bin" / "vllm-router"
KEY_A = {"Authorization": "Bearer key-a"}
# short of a block, a block and a bit, many blocks and a bit
LENGTHS = [BLOCK - 3, 2 * BLOCK + 5, 13 * BLOCK + 7]

pytestmark = pytest.mark.skipif(
    not VLLM_ROUTER.exists(), reason=f"vllm-router not installed at {VLLM_ROUTER} (../shared/anchors/setup.sh routers)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmRouter:
    """`vllm-router --vllm-pd-disaggregation` as a subprocess on a free port (``with`` starts and stops it)."""

    def __init__(self, prefill: str, decode: str, api_key: str, log: Path):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(self.port),
            "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
        ]  # fmt: skip
        # the key it sends the replicas: its environment's, not the client's (see the module's doc)
        self.env = {**os.environ, "OPENAI_API_KEY": api_key}

    def __enter__(self) -> VllmRouter:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"vllm-router exited: {self.log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vllm-router did not start: {self.log.read_text()[-2000:]}"
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    """(single, prefill, decode, router): a plain replica as the reference, a P/D pair, vllm-router."""
    tmp = tmp_path_factory.mktemp("vllm-router")
    common = [*TINY_ARGS, *SECRET, "--api-keys", str(write_keys(tmp / "keys.txt"))]
    with (
        ServerThread(tiny_model_dir, *common) as single,
        ServerThread(tiny_model_dir, *common, "--role", "prefill") as prefill,
        ServerThread(tiny_model_dir, *common, "--role", "decode") as decode,
        VllmRouter(prefill.url, decode.url, "key-a", tmp / "router.log") as router,
    ):
        yield single, prefill, decode, router


def assert_idle(single: ServerThread, prefill: ServerThread, decode: ServerThread) -> None:
    """Nothing runs and no block is in use on either replica (no lease left on the prefill one)."""
    for server in (single, prefill, decode):
        wait_idle(server.url)
    for server in (prefill, decode):
        server.engine.engine.kv.check_integrity()
        assert server.engine.engine.kv.pool.num_used_blocks == 0
    assert metrics(prefill.url)[("kvserve:kv_leases", ())] == 0  # every lease pulled and released


def computed_by(url: str, before: dict) -> tuple[float, dict]:
    """Prompt tokens a replica computed (not found cached) since the metrics `before`, and the metrics now."""
    now = metrics(url)

    def uncached(m: dict) -> float:
        cached = sum(v for (name, _), v in m.items() if name == "kvserve:tenant_cached_tokens_total")
        return m.get(("kvserve:prompt_tokens_total", ()), 0) - cached

    return uncached(now) - uncached(before), now


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllm_router_in_pd_mode_in_front_of_kvserve_replicas_requests_succeed(deployment, chat, stream):
    single, prefill, decode, router = deployment
    decode_metrics = metrics(decode.url)
    for i, n in enumerate(LENGTHS):
        path, body = request_body(n, chat, stream, seed=50 + i + 10 * chat + 20 * stream)
        direct = httpx.post(f"{single.url}{path}", json=body, headers=KEY_A, timeout=120)
        expected, expected_use = text_of(direct, chat, stream)
        # the client's own key: vllm-router drops it and sends its OPENAI_API_KEY (key-a) instead
        r = httpx.post(f"{router.url}{path}", json=body, headers={"Authorization": "Bearer key-b"}, timeout=120)
        got, use = text_of(r, chat, stream)
        assert got == expected, (n, got, expected)
        assert use["prompt_tokens"] == expected_use["prompt_tokens"], use
        # vllm-router relays the decode replica's usage with the prefill replica's cached_tokens,
        # so what the decode replica computed is read off its own counters
        computed, decode_metrics = computed_by(decode.url, decode_metrics)
        assert 1 <= computed <= BLOCK, (n, computed, use)
    assert_idle(single, prefill, decode)
    received = metrics(decode.url)[("kvserve:kv_transfer_blocks_total", (("direction", "received"),))]
    assert received > 0
    # every request reached the replicas as tenant A, the router's key, whatever the client sent
    tenants = {labels for (name, labels) in metrics(decode.url) if name == "kvserve:tenant_requests_total"}
    assert tenants == {(("tenant", "A"),)}, tenants


def test_concurrent_requests_through_vllm_router_overlap_their_handoffs(deployment):
    single, prefill, decode, router = deployment
    bodies = [request_body(6 * BLOCK + i, chat=i % 2 == 1, stream=i % 3 == 0, seed=90 + i) for i in range(6)]
    expected = [text_of(httpx.post(f"{single.url}{p}", json=b, headers=KEY_A, timeout=120), "chat" in p, b["stream"])[0]
                for p, b in bodies]  # fmt: skip

    def through_router(path_body: tuple[str, dict]) -> str:
        path, body = path_body
        return text_of(httpx.post(f"{router.url}{path}", json=body, timeout=120), "chat" in path, body["stream"])[0]

    with ThreadPoolExecutor(len(bodies)) as pool:
        assert list(pool.map(through_router, bodies)) == expected
    assert_idle(single, prefill, decode)
