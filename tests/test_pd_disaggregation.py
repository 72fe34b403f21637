"""Prefill/decode disaggregation: a prefill replica computes a prompt and holds its blocks,
a decode replica pulls them (direct path) and generates, with outputs equal to one replica's.

Both replicas run in this process (servers in threads) on the tiny random-weight model, in
fp32, sharing a cache secret as one deployment's replicas do.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.server.kv_transfer import transfer_token
from tests.test_server_common import TINY_ARGS, ServerThread, error_of, metrics, wait_idle, write_keys

SECRET = ["--cache-secret", "pd-test-secret"]
BLOCK = 16
# 1 token short of a block, 1 and 2 blocks and a bit, a multiple of the block size, many blocks
PROMPT_LENGTHS = [BLOCK - 1, BLOCK + 3, 2 * BLOCK + 5, 4 * BLOCK, 13 * BLOCK + 7]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("pd") / "keys.txt")


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, keys_file):
    """(single, prefill, decode): a plain replica as the reference, and a P/D pair."""
    common = [*TINY_ARGS, *SECRET, "--api-keys", str(keys_file)]
    with (
        ServerThread(tiny_model_dir, *common) as single,
        ServerThread(tiny_model_dir, *common, "--role", "prefill") as prefill,
        ServerThread(tiny_model_dir, *common, "--role", "decode") as decode,
    ):
        yield single, prefill, decode


def post(server: ServerThread, path: str, body: dict, key: str = "key-a") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def prefill_call(prefill: ServerThread, path: str, body: dict, key: str = "key-a") -> dict:
    """What a router sends a prefill replica (vLLM's shape); returns its kv_transfer_params."""
    handoff = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    body = {k: v for k, v in body.items() if k != "stream_options"}
    r = post(prefill, path, {**body, **handoff}, key)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] and params["remote_engine_id"]
    return params


def text_of(response: httpx.Response, chat: bool, stream: bool) -> tuple[str, dict]:
    """The generated text and the usage of a response, streamed or not."""
    assert response.status_code == 200, response.text
    if not stream:
        body = response.json()
        choice = body["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), body["usage"]
    text, usage = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
        usage = chunk.get("usage") or usage
    return text, usage


def request_body(n: int, chat: bool, stream: bool, seed: int = 0) -> tuple[str, dict]:
    body: dict = {"max_tokens": 12, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:  # text whose token count grows with n
        words = " ".join(f"w{(seed * 31 + i) % 97}" for i in range(max(1, n // 3)))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}
    return "/v1/completions", {**body, "prompt": prompt_of(n, seed)}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_outputs_through_prefill_and_decode_equal_one_replica(replicas, chat, stream):
    single, prefill, decode = replicas
    for i, n in enumerate(PROMPT_LENGTHS):
        path, body = request_body(n, chat, stream, seed=i + 10 * chat + 20 * stream)
        expected, _ = text_of(post(single, path, body), chat, stream)
        params = prefill_call(prefill, path, body)
        got, use = text_of(post(decode, path, {**body, "kv_transfer_params": params}), chat, stream)
        assert got == expected, (n, got, expected)
        computed = use["prompt_tokens"] - use["prompt_tokens_details"]["cached_tokens"]
        # the decode replica computes at most the last partial block and the last prompt token
        assert 1 <= computed <= BLOCK, (n, use)
        if use["prompt_tokens"] > BLOCK:
            assert params["remote_block_ids"], params
    for server in replicas:
        wait_idle(server.url)
    for server in (prefill, decode):
        server.engine.engine.kv.check_integrity()
        assert server.engine.engine.kv.pool.num_used_blocks == 0
    sent = metrics(prefill.url)[("kvserve:kv_transfer_blocks_total", (("direction", "sent"),))]
    received = metrics(decode.url)[("kvserve:kv_transfer_blocks_total", (("direction", "received"),))]
    assert sent == received > 0
    # the dashboard's JSON shows each replica's role and its handoffs, as /metrics counts them
    auth = {"Authorization": "Bearer key-a"}
    shown = {s: httpx.get(f"{s.url}/debug/kv_state", headers=auth).json() for s in (prefill, decode)}
    assert shown[prefill]["role"] == "prefill" and shown[prefill]["handoffs"]["sent_blocks"] == sent
    assert shown[decode]["role"] == "decode" and shown[decode]["handoffs"]["received_blocks"] == received


def test_server_info_reports_the_role_and_the_transfer_endpoint(replicas):
    _, prefill, decode = replicas
    info = httpx.get(f"{prefill.url}/server_info").json()
    assert info["role"] == "prefill" and info["kv_transfer_endpoint"] == f"{prefill.url}/kv_transfer/pull"
    info = httpx.get(f"{decode.url}/server_info").json()
    assert info["role"] == "decode" and info["kv_transfer_endpoint"] is None


def test_a_pull_for_another_tenant_gets_none_of_the_blocks(replicas):
    single, prefill, decode = replicas
    path, body = request_body(6 * BLOCK, chat=False, stream=False, seed=99)
    params = prefill_call(prefill, path, body, key="key-a")  # tenant A's prompt, held for A
    assert len(params["remote_block_ids"]) == 6
    # tenant B sends A's params: its keys are under B's salt, so nothing matches
    got, use = text_of(post(decode, path, {**body, "kv_transfer_params": params}, key="key-b"), False, False)
    assert use["prompt_tokens_details"]["cached_tokens"] == 0
    assert got == text_of(post(single, path, body, key="key-b"), False, False)[0]
    wait_idle(prefill.url)  # the pull released the lease all the same


def test_a_pull_without_the_secret_is_refused(replicas):
    _, prefill, _ = replicas
    path, body = request_body(3 * BLOCK, chat=False, stream=False, seed=7)
    params = prefill_call(prefill, path, body)
    pull = {"remote_request_id": params["remote_request_id"], "block_keys": ["00" * 32]}
    r = httpx.post(f"{prefill.url}/kv_transfer/pull", json=pull, headers={"X-KV-Transfer-Token": "0" * 64})
    assert r.status_code == 403 and error_of(r)["code"] == "invalid_transfer_token"
    release = {"remote_request_id": params["remote_request_id"]}
    token = transfer_token(b"pd-test-secret", release["remote_request_id"])
    r = httpx.post(f"{prefill.url}/kv_transfer/release", json=release, headers={"X-KV-Transfer-Token": token})
    assert r.status_code == 200
    wait_idle(prefill.url)


def test_an_expired_lease_frees_its_blocks_and_the_decode_side_recomputes(tiny_model_dir, keys_file):
    common = [*TINY_ARGS, *SECRET, "--api-keys", str(keys_file)]
    with (
        ServerThread(tiny_model_dir, *common, "--role", "prefill", "--kv-lease-seconds", "0.3") as prefill,
        ServerThread(tiny_model_dir, *common, "--role", "decode") as decode,
    ):
        path, body = request_body(5 * BLOCK, chat=False, stream=False, seed=3)
        params = prefill_call(prefill, path, body)
        assert prefill.engine.load().kv_leases == 1
        wait_idle(prefill.url, timeout=5)  # the engine, idle, still frees it on time
        m = metrics(prefill.url)
        assert m[("kvserve:kv_lease_expiries_total", ())] == 1 and m[("kvserve:kv_leases", ())] == 0
        expected, _ = text_of(post(prefill, path, body), False, False)
        got, use = text_of(post(decode, path, {**body, "kv_transfer_params": params}), False, False)
        assert got == expected and use["prompt_tokens_details"]["cached_tokens"] == 0
        wait_idle(decode.url)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_replica_gone_after_answering_is_a_recompute_or_with_fail_an_error(tiny_model_dir, keys_file, policy):
    common = [*TINY_ARGS, *SECRET, "--api-keys", str(keys_file)]
    with ServerThread(tiny_model_dir, *common, "--role", "decode", "--kv-load-failure-policy", policy) as decode:
        with ServerThread(tiny_model_dir, *common, "--role", "prefill") as prefill:
            path, body = request_body(4 * BLOCK, chat=False, stream=False, seed=5)
            params = prefill_call(prefill, path, body)
            expected, _ = text_of(post(prefill, path, body), False, False)
        # the prefill replica is gone: its port refuses the pull
        r = post(decode, path, {**body, "kv_transfer_params": params})
        if policy == "recompute":
            got, use = text_of(r, False, False)
            assert got == expected and use["prompt_tokens_details"]["cached_tokens"] == 0
        else:
            assert r.status_code == 500 and error_of(r)["code"] == "kv_load_failed"
        assert metrics(decode.url)[("kvserve:kv_load_failures_total", ())] == 1
        wait_idle(decode.url)  # and it keeps serving
        assert post(decode, path, body).status_code == 200


def test_a_decode_replica_refuses_to_prefill_for_others(replicas):
    _, _, decode = replicas
    path, body = request_body(2 * BLOCK, chat=False, stream=False)
    r = post(decode, path, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "role is decode" in error_of(r)["message"]


@pytest.mark.parametrize("store", ["redis_server", "redis_cluster"])
def test_the_handoff_through_a_shared_redis_tier(tiny_model_dir, keys_file, store, request):
    url = request.getfixturevalue(store).url()
    common = [*TINY_ARGS, *SECRET, "--api-keys", str(keys_file), "--kv-remote", url]
    with (
        ServerThread(tiny_model_dir, *TINY_ARGS, *SECRET, "--api-keys", str(keys_file)) as single,
        ServerThread(tiny_model_dir, *common, "--role", "prefill") as prefill,
        ServerThread(tiny_model_dir, *common, "--role", "decode") as decode,
    ):
        for i, n in enumerate([BLOCK + 3, 4 * BLOCK, 13 * BLOCK + 7]):
            path, body = request_body(n, chat=False, stream=False, seed=40 + i)
            params = prefill_call(prefill, path, body)
            assert params["kv_path"] == "redis"
            wait_idle(prefill.url)  # nothing held: the blocks are in Redis
            got, use = text_of(post(decode, path, {**body, "kv_transfer_params": params}), False, False)
            assert got == text_of(post(single, path, body), False, False)[0]
            assert 1 <= use["prompt_tokens"] - use["prompt_tokens_details"]["cached_tokens"] <= BLOCK, use
        for server in (prefill, decode):
            wait_idle(server.url)
        assert ("kvserve:kv_transfer_blocks_total", (("direction", "received"),)) not in metrics(decode.url)


def test_a_pull_cut_short_releases_the_lease_at_once():
    """The decode side's client leaves (the pull is cancelled) while the prefill replica has not answered:
    the lease is released now, with the transfer token, not left to expire."""
    import asyncio

    from aiohttp import web

    from kvserve.entrypoints.cluster import free_port
    from kvserve.server.kv_transfer import TOKEN_HEADER, pull_blocks

    released: list[tuple[dict, str | None]] = []
    done = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await done.wait()
        return web.Response()

    async def release(request: web.Request) -> web.Response:
        released.append((await request.json(), request.headers.get(TOKEN_HEADER)))
        return web.json_response({"released": True})

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/kv_transfer/pull", hang)
        app.router.add_post("/kv_transfer/release", release)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        params = {"remote_request_id": "cmpl-7-0", "remote_host": "127.0.0.1", "remote_port": port}
        try:
            pull = asyncio.ensure_future(pull_blocks(params, [b"k" * 32], b"pd-test-secret", 100))
            await asyncio.sleep(0.3)
            pull.cancel()
            for _ in range(50):
                if released:
                    break
                await asyncio.sleep(0.1)
        finally:
            done.set()
            await runner.cleanup()

    asyncio.run(run())
    assert released == [({"remote_request_id": "cmpl-7-0"}, transfer_token(b"pd-test-secret", "cmpl-7-0"))]


def test_a_replica_of_role_both_given_a_handoff_computes_the_prompt_and_releases_the_lease(replicas):
    """Only --role decode takes handed-off blocks (a replica of role both keeps no room for them): a
    replica of role both computes the prompt itself, and the prefill replica's lease is released at
    once rather than pulled for nothing or held until it expires."""
    single, prefill, decode = replicas
    path, body = request_body(6 * BLOCK + 3, chat=False, stream=False, seed=41)
    expected, _ = text_of(post(decode, path, body, key="key-b"), False, False)  # another tenant: shares nothing
    params = prefill_call(prefill, path, body)
    got, use = text_of(post(single, path, {**body, "kv_transfer_params": params}), False, False)
    assert got == expected and use["prompt_tokens_details"]["cached_tokens"] == 0
    wait_idle(prefill.url, timeout=5)  # well before the lease's 30 s
    assert metrics(prefill.url)[("kvserve:kv_lease_expiries_total", ())] == 0
