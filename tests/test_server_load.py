"""64 concurrent streaming clients, a quarter of them hanging up mid-stream: no leak, no lost tokens."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from test_server_common import ServerThread, wait_idle

CLIENTS = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # a pool of 96 blocks cannot hold 64 requests of 2+ blocks each: preemption happens too
    args = ["--dtype", "float32", "--num-kv-blocks", "96", "--max-model-len", "512"]
    with ServerThread(tiny_model_dir, *args) as s:
        yield s


async def stream_client(http: httpx.AsyncClient, i: int, hang_up_after: int | None) -> int | None:
    """Stream one completion; the number of tokens it got, or None if it hung up."""
    body = {
        "prompt": f"client {i} says " + "hello " * (i % 7),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, usage = 0, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return None  # leaving the block closes the connection mid-stream
            else:
                usage = chunk["usage"]
    return usage["completion_tokens"]


async def run_clients(url: str) -> list[int | None]:
    rng = random.Random(0)
    hang_ups = set(rng.sample(range(CLIENTS), CLIENTS // 4))
    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        tasks = [
            stream_client(http, i, rng.randint(1, MAX_TOKENS - 2) if i in hang_ups else None) for i in range(CLIENTS)
        ]
        return await asyncio.gather(*tasks)


def test_concurrent_streams_with_hang_ups(server):
    stats = server.engine.engine.stats
    results = asyncio.run(run_clients(server.url))
    assert results.count(None) == CLIENTS // 4
    assert all(n == MAX_TOKENS for n in results if n is not None)
    assert stats.generation_tokens < CLIENTS * MAX_TOKENS  # hung-up requests stopped early
    m = wait_idle(server.url)  # every abandoned request was aborted and its blocks freed
    kv = server.engine.engine.kv
    kv.pool.check_integrity()
    assert kv.pool.num_used_blocks == 0 and not kv.block_tables
    assert m[("kvserve:num_preemptions_total", ())] > 0
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "still here", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_non_streaming_client_that_hangs_up_is_aborted(server):
    """A client that gives up before its (non-streamed) answer is ready frees its request at once."""
    slow_step = lambda outputs: time.sleep(0.02)  # noqa: E731  400 steps now take 8 s at least
    server.engine.on_step.append(slow_step)
    body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "n": 4}
    before = server.engine.engine.stats.generation_tokens
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        wait_idle(server.url, timeout=3)
    finally:
        server.engine.on_step.remove(slow_step)
    assert server.engine.engine.stats.generation_tokens - before < 4 * 100
