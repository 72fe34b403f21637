"""The router's half of prefill/decode disaggregation (issue #48): decode first, then a prefill replica only
for a long uncached prompt and only while one is healthy and not backed up; a prefill replica failing is a
local prefill, never a failed request.

First the decision over real `Replica` objects scored by the router's own policy, then (where the
replicas take `--role`) `kvserve router --prefill ... --decode ...` in front of real replica processes:
greedy outputs equal a single replica's, and a SIGKILLed prefill replica fails no request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import dataclass

import httpx
import pytest
from test_router import Process, _auth, _wait_until, cached, replica_process, serve_post
from test_server_common import metrics, write_keys

from kvserve.entrypoints.cluster import free_port
from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.events import BlockStored
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.router.app import RouterSettings
from kvserve.router.args import add_router_args
from kvserve.router.index import SentBlocks
from kvserve.router.metrics import RouterMetrics
from kvserve.router.pd import LOCAL, handoff_params, prefill_body, wants_remote_prefill
from kvserve.router.policy import make_policy
from kvserve.router.proxy import PATHS, Proxy
from kvserve.router.replicas import (
    PREFILL_QUEUE_LIMIT,
    Flight,
    Replica,
    ReplicaLoad,
    ReplicaSet,
    ServerInfo,
    State,
)
from kvserve.router.request import RoutedRequest
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.server.auth import cache_salt

SECRET = "router-test-secret"
BS = 16
MAX_LOCAL = 64  # --max-local-prefill-tokens of these tests: 4 blocks


def keys_of(tokens: list[int], tenant: str = "A") -> list[bytes]:
    return chain_keys(b"", tokens, BS, extra_key(cache_salt(SECRET.encode(), tenant)))


def _replica(index: int, role: str | None, blocks: list[bytes] = (), reported: str = "both") -> Replica:
    info = ServerInfo("m", "m", "/x", BS, 1000, 4096, None, False, role=reported)
    r = Replica(index, f"http://r{index}", State.HEALTHY, info, sent=SentBlocks(1000), configured_role=role)
    r.subscriber = type("Sub", (), {"last_event_time": None, "last_seq": 0, "close": lambda self: None})()
    r.events.apply([BlockStored(list(blocks), None, [], BS)] if blocks else [])
    return r


def _set(replicas: list[Replica]) -> ReplicaSet:
    """A `ReplicaSet` over replicas made here (never started: no health checks)."""
    replica_set = ReplicaSet([], httpx.AsyncClient(), None)
    replica_set.replicas = replicas
    return replica_set


def _proxy(replicas: list[Replica]) -> tuple[Proxy, RouterMetrics]:
    metrics = RouterMetrics()
    proxy = Proxy(_set(replicas), make_policy("cache_aware"), metrics, SECRET.encode(), 5.0)
    proxy.max_local_prefill_tokens = MAX_LOCAL
    return proxy, metrics


def _request(tokens: list[int], **body: object) -> RoutedRequest:
    return RoutedRequest("completion", {"prompt": tokens, **body}, "A", None, [tokens], [keys_of(tokens)])


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(f"kvserve:router_{name}_total", labels) or 0.0


def test_a_short_or_warm_prompt_prefills_on_its_decode_replica_a_long_cold_one_remotely():
    """Decode first: the tokens to compute are those its chosen decode replica lacks."""
    long = list(range(20 * BS + 5))
    warm = _replica(0, "decode", keys_of(long)[:18])  # all but 2 blocks + 5 tokens cached: 37 to compute
    cold = _replica(1, "decode")
    policy = make_policy("cache_aware")
    decision = policy.choose(_request(long), [warm, cold])
    assert decision.replica is warm and decision.uncached_tokens == 2 * BS + 5
    assert wants_remote_prefill(_request(long), decision, MAX_LOCAL) == "short"
    alone = policy.choose(_request(long), [cold])
    assert alone.uncached_tokens == len(long)
    assert wants_remote_prefill(_request(long), alone, MAX_LOCAL) is None
    short = list(range(MAX_LOCAL))
    assert wants_remote_prefill(_request(short), policy.choose(_request(short), [cold]), MAX_LOCAL) == "short"
    batch = RoutedRequest("completion", {}, "A", None, [long, long], [keys_of(long)] * 2)
    assert wants_remote_prefill(batch, policy.choose(batch, [cold]), MAX_LOCAL) == "batch"
    beams = _request(long, use_beam_search=True, n=2)  # a replica hands off sampled requests only
    assert wants_remote_prefill(beams, alone, MAX_LOCAL) == "beam_search"


def test_requests_are_served_by_decode_and_both_replicas_never_by_a_prefill_one():
    prefill, decode, plain = _replica(0, "prefill"), _replica(1, "decode"), _replica(2, None)
    reported = _replica(3, None, reported="prefill")  # given as --replica: its /server_info decides
    replicas = _set([prefill, decode, plain, reported])
    assert [r.index for r in replicas.candidates(set())] == [1, 2]
    assert [r.index for r in replicas.prefill_candidates(set())] == [0, 3]
    assert plain.role == "both" and reported.role == "prefill"
    for r in (decode, plain):
        r.state = State.DEAD
    r.refused = True
    assert [r.index for r in replicas.candidates(set())] == [1]  # panic mode: dead of timeouts only, still no prefill


def test_a_prefill_replica_unhealthy_or_backed_up_is_no_candidate():
    p0, p1 = _replica(0, "prefill"), _replica(1, "prefill")
    replicas = _set([p0, p1, _replica(2, "decode")])
    p0.state = State.DEAD
    assert replicas.prefill_candidates(set()) == [p1]
    p1.load = ReplicaLoad(running=1, waiting=PREFILL_QUEUE_LIMIT + 1)  # its /load says so
    assert replicas.prefill_candidates(set()) == []
    p1.load = ReplicaLoad()
    for _ in range(PREFILL_QUEUE_LIMIT + 1):  # one computing, the rest queued: the router's own count says so
        p1.add_flight(Flight(prompt_tokens=400, uncached_tokens=400))
    assert replicas.prefill_candidates(set()) == [p1]
    p1.add_flight(Flight(prompt_tokens=400, uncached_tokens=400))
    assert replicas.prefill_candidates(set()) == []


def test_without_a_free_prefill_replica_a_long_prompt_prefills_locally_and_says_why():
    long = list(range(20 * BS + 5))
    prefill, decode = _replica(0, "prefill"), _replica(1, "decode")
    prefill.state = State.DEAD
    proxy, metrics = _proxy([prefill, decode])
    request = _request(long)
    decision = proxy.choose(request, set())
    assert decision.replica is decode
    assert asyncio.run(proxy._handoff(request, decision)) is LOCAL
    assert _sample(metrics, "local_prefills", reason="no_prefill_replica") == 1
    short = _request(list(range(10)))
    assert asyncio.run(proxy._handoff(short, proxy.choose(short, set()))) is LOCAL
    assert _sample(metrics, "local_prefills", reason="short") == 1
    assert _sample(metrics, "remote_prefills", replica=prefill.url) == 0


def test_a_failing_prefill_replica_is_retried_on_the_next_then_given_up_for_a_local_prefill():
    """Two prefill replicas, one answering 500 and one cutting the connection before answering: each is
    tried once (the cut one out at once, as a refused connection makes it), then the decode replica
    prefills the prompt itself, the request unharmed."""
    from aiohttp import web

    async def error(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def cut(request: web.Request) -> web.Response:
        request.transport.close()  # reset before any answer
        return web.Response()

    async def run() -> tuple[object, RouterMetrics, list[Replica]]:
        runners, replicas = [], []
        for i, handler in enumerate((error, cut)):
            runner, port = await serve_post("/v1/completions", handler)
            runners.append(runner)
            r = _replica(i, "prefill")
            r.url = f"http://127.0.0.1:{port}"
            replicas.append(r)
        decode = _replica(2, "decode")
        proxy, metrics = _proxy([*replicas, decode])
        await proxy.start()
        try:
            request = _request(list(range(20 * BS + 5)))
            handoff = await proxy._handoff(request, proxy.choose(request, set()))
        finally:
            await proxy.close()
            for runner in runners:
                await runner.cleanup()
        return handoff, metrics, replicas

    handoff, metrics, (errored, reset) = asyncio.run(run())
    assert handoff is LOCAL
    assert _sample(metrics, "retries", reason="server_error") == 1
    assert _sample(metrics, "retries", reason="connection") == 1
    assert _sample(metrics, "local_prefills", reason="fallback") == 1
    assert (
        _sample(metrics, "prefill_fallbacks", reason="connection")
        + _sample(metrics, "prefill_fallbacks", reason="server_error")
        == 1
    )
    assert reset.state is State.DEAD and errored.failures == 1  # a 5xx counts; two in a row would kill it


def test_the_prefill_call_asks_for_the_prompts_kv_and_one_whole_token():
    tokens = list(range(100))
    body = {"prompt": tokens, "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    sent = prefill_body(_request(tokens, **body))
    assert sent == {
        "prompt": tokens,
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    chat = RoutedRequest("chat", {"messages": [], "max_completion_tokens": 9, "min_tokens": 3}, "A", None)
    assert prefill_body(chat)["max_completion_tokens"] == 1 and "min_tokens" not in prefill_body(chat)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": [3, 4],
        "remote_host": "127.0.0.1",
        "remote_port": 9,
    }
    assert handoff_params({"kv_transfer_params": params}) == params
    assert handoff_params({"kv_transfer_params": None}) is None  # it could not hold the blocks
    assert handoff_params({"choices": []}) is None


def test_router_flags_give_each_replica_its_role():
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(["--replica", "http://a", "--prefill", "http://p", "--decode", "http://d"])
    settings = RouterSettings.from_args(args)
    assert settings.replicas == ["http://a", "http://p", "http://d"]
    assert settings.roles == [None, "prefill", "decode"] and settings.max_local_prefill_tokens == 512
    with pytest.raises(ValueError, match="--decode"):
        RouterSettings.from_args(parser.parse_args(["--prefill", "http://p"]))
    with pytest.raises(ValueError, match="max-local-prefill-tokens"):
        RouterSettings.from_args(parser.parse_args(["--decode", "http://d", "--max-local-prefill-tokens", "-1"]))


def test_server_info_without_a_role_is_both():
    data = {"model": "m", "served_model_name": "m", "tokenizer_dir": "/x", "block_size": 16}
    data |= {"num_kv_blocks": 10, "max_model_len": 64}
    assert ServerInfo.from_json(data, "http://r").role == "both"
    assert ServerInfo.from_json({**data, "role": "decode"}, "http://r").role == "decode"


# --- the cluster: one prefill and one decode replica behind the router ------------------------------


@dataclass
class PD:
    prefill: Process
    decode: Process
    router: Process
    tokenizer: RouterTokenizer

    def post(self, url: str, path: str, body: dict, key: str = "key-a") -> httpx.Response:
        response = httpx.post(f"{url}{path}", json=body, headers=_auth(key), timeout=120)
        assert response.status_code == 200, response.text
        return response


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-pd")
    keys = write_keys(tmp / "keys")
    prefill = replica_process(tiny_model_dir, tmp, 0)
    decode = replica_process(tiny_model_dir, tmp, 1)
    prefill.cmd += ["--role", "prefill"]
    decode.cmd += ["--role", "decode"]
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--port", str(port)]
    cmd += ["--prefill", prefill.url, "--decode", decode.url, "--max-local-prefill-tokens", str(MAX_LOCAL)]
    cmd += ["--api-keys", str(keys), "--cache-secret", SECRET]
    router = Process(cmd, f"http://127.0.0.1:{port}", tmp / "router.log")
    try:
        for p in (prefill, decode):
            p.start()
        for p in (prefill, decode):
            p.wait_healthy()
        router.start()
        router.wait_healthy(timeout=60)
        state = lambda: httpx.get(f"{router.url}/router/replicas", headers=_auth("key-a"), timeout=5).json()  # noqa: E731
        _wait_until(lambda: all(r["state"] == "healthy" for r in state()), 10, "replicas discovered")
        assert [r["role"] for r in state()] == ["prefill", "decode"]
        yield PD(prefill, decode, router, RouterTokenizer.from_dir(tiny_model_dir))
    finally:
        for p in (router, prefill, decode):
            if p.proc is not None:
                p.stop()


def _long_text(tok: RouterTokenizer, topic: str, tokens: int = 200) -> str:
    """A prompt of about `tokens` tokens, unlike any other test's (so cold on every replica)."""
    words: list[str] = []
    while len(tok.encode(" ".join(words))) < tokens:
        words.append(f"{topic}-{len(words)}")
    return " ".join(words)


def _text(kind: str, body: dict, response: httpx.Response) -> tuple[str, dict]:
    if not body.get("stream"):
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        return (choice["text"] if kind == "completion" else choice["message"]["content"]), usage
    text, usage = "", None
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, usage


def _body(kind: str, text: str, stream: bool) -> dict:
    body: dict = {"max_tokens": 16, "temperature": 0}
    body |= {"prompt": text} if kind == "completion" else {"messages": [{"role": "user", "content": text}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _counter(url: str, name: str) -> float:
    return sum(v for (n, _), v in metrics(url).items() if n == f"kvserve:router_{name}_total")


CASES = [("completion", False), ("completion", True), ("chat", False), ("chat", True)]


@pytest.mark.parametrize(("kind", "stream"), CASES)
def test_a_long_prompt_prefilled_remotely_decodes_as_one_replica_alone_would(pd, kind, stream):
    """The reference is the decode replica itself, computing the prompt under another tenant (no block of
    tenant A's to find); through the router the prompt is cold there too, so a prefill replica computes
    it and the decode replica pulls it: the same greedy text, every whole block but the last token's
    reported cached, as the router predicted."""
    path = PATHS[kind]
    body = _body(kind, _long_text(pd.tokenizer, f"{kind}{int(stream)}"), stream)
    alone, _ = _text(kind, body, pd.post(pd.decode.url, path, body, key="key-b"))
    remote_before = _counter(pd.router.url, "remote_prefills")
    response = pd.post(pd.router.url, path, body)
    text, usage = _text(kind, body, response)
    assert text == alone and text
    assert _counter(pd.router.url, "remote_prefills") == remote_before + 1
    assert response.headers["x-kvserve-replica"] == "1"
    assert cached(usage) == int(response.headers["x-kvserve-predicted-cached-tokens"]) >= 10 * BS
    # the same prompt again: its blocks are on the decode replica now, a local prefill of the last block
    local_before = _counter(pd.router.url, "local_prefills")
    again, usage = _text(kind, body, pd.post(pd.router.url, path, body))
    assert again == alone and _counter(pd.router.url, "local_prefills") == local_before + 1


def test_a_short_prompt_never_leaves_its_decode_replica(pd):
    remote_before = _counter(pd.router.url, "remote_prefills")
    pd.post(pd.router.url, "/v1/completions", {"prompt": "Short and sweet.", "max_tokens": 4})
    assert _counter(pd.router.url, "remote_prefills") == remote_before


def test_a_prefill_replica_frozen_mid_prefill_is_a_local_prefill(pd):
    """SIGSTOP: the prefill call hangs without an answer until the health checks find the replica dead
    (~1.5 s) and cut it; the decode replica then computes the prompt, the same greedy text."""
    body = _body("completion", _long_text(pd.tokenizer, "frozen"), False)
    alone, _ = _text("completion", body, pd.post(pd.decode.url, "/v1/completions", body, key="key-b"))
    fallbacks = _counter(pd.router.url, "prefill_fallbacks")
    pd.prefill.proc.send_signal(signal.SIGSTOP)
    try:
        text, _ = _text("completion", body, pd.post(pd.router.url, "/v1/completions", body))
    finally:
        pd.prefill.proc.send_signal(signal.SIGCONT)
    assert text == alone
    assert _counter(pd.router.url, "prefill_fallbacks") == fallbacks + 1
    state = lambda: httpx.get(f"{pd.router.url}/router/replicas", headers=_auth("key-a"), timeout=5).json()  # noqa: E731
    _wait_until(lambda: state()[0]["state"] == "healthy", 15, "the thawed prefill replica discovered again")


def test_no_request_fails_when_the_prefill_replica_is_sigkilled(pd):
    """Killed with no warning: the router's next prefill call is refused (or the health check got there
    first) and the decode replica computes the prompt itself, the same greedy text."""
    body = _body("completion", _long_text(pd.tokenizer, "after-the-kill"), False)
    alone, _ = _text("completion", body, pd.post(pd.decode.url, "/v1/completions", body, key="key-b"))
    pd.prefill.stop(signal.SIGKILL)
    text, _ = _text("completion", body, pd.post(pd.router.url, "/v1/completions", body))
    assert text == alone
    streamed = _body("chat", _long_text(pd.tokenizer, "after-the-kill-chat"), True)
    assert _text("chat", streamed, pd.post(pd.router.url, "/v1/chat/completions", streamed))[0]
    fell_back = _counter(pd.router.url, "prefill_fallbacks")
    m = metrics(pd.router.url)
    no_prefill = m.get(("kvserve:router_local_prefills_total", (("reason", "no_prefill_replica"),)), 0)
    assert fell_back + no_prefill >= 2


def test_a_handoff_no_decode_replica_takes_is_released_at_once():
    """The decode replica refuses the request (a 4xx) after a prefill replica computed the prompt: the
    router releases that replica's lease now, with the transfer token, rather than leave it to expire."""
    from aiohttp import web

    from kvserve.server.kv_transfer import TOKEN_HEADER, transfer_token

    released: list[tuple[dict, str | None]] = []

    async def release(request: web.Request) -> web.Response:
        released.append((await request.json(), request.headers.get(TOKEN_HEADER)))
        return web.json_response({"released": True})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no", "type": "invalid_request_error"}}, status=400)

    async def run() -> int:
        release_runner, release_port = await serve_post("/kv_transfer/release", release)
        params = {"do_remote_prefill": True, "remote_request_id": "cmpl-9-0", "remote_host": "127.0.0.1"}

        async def prefill(request: web.Request) -> web.Response:
            return web.json_response({"choices": [], "kv_transfer_params": {**params, "remote_port": release_port}})

        runners = [release_runner]
        replicas = []
        for i, (role, handler) in enumerate((("prefill", prefill), ("decode", refuse))):
            runner, port = await serve_post("/v1/completions", handler)
            runners.append(runner)
            r = _replica(i, role)
            r.url = f"http://127.0.0.1:{port}"
            replicas.append(r)
        proxy, _ = _proxy(replicas)
        await proxy.start()
        try:
            response = await proxy.forward(_request(list(range(20 * BS + 5))))
            for _ in range(50):
                if released:
                    break
                await asyncio.sleep(0.1)
        finally:
            await proxy.close()
            for runner in runners:
                await runner.cleanup()
        return response.status_code

    assert asyncio.run(run()) == 400
    assert released == [({"remote_request_id": "cmpl-9-0"}, transfer_token(SECRET.encode(), "cmpl-9-0"))]
