"""`kvserve router` in front of three tiny-model replicas, each its own `kvserve serve` process
publishing KV events; the router is its own process too, as deployed.

First the parts alone (index, fallback, policy, tokenizer, migration bookkeeping), then
the cluster: tokenization equal to the replicas', a chat's turns on the replica holding its
history, no tenant scored against another's blocks, every predicted cached-token count
equal to the replica's report, a SIGKILLed replica under 64 streams failing no request
(cut streams migrated, their text equal to an uninterrupted run's), and the restarted
replica indexed from scratch.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from test_server_common import TINY_ARGS, metrics, write_keys

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.entrypoints.cluster import free_port
from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.router import request as request_module
from kvserve.router.index import BlockIndex, SentBlocks
from kvserve.router.migration import StreamCut, StreamProgress, upstream_body
from kvserve.router.policy import CacheAware, Decision, make_policy, score
from kvserve.router.proxy import PATHS, Upstream
from kvserve.router.replicas import EVENTS_STALE_AFTER, Flight, Replica, ServerInfo, State
from kvserve.router.request import RoutedRequest, Tokenization
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.server.auth import cache_salt

SECRET = "router-test-secret"
BS = 16

# --- the parts ------------------------------------------------------------------------------------


def keys_of(tokens: list[int], tenant: str = "A") -> list[bytes]:
    return chain_keys(b"", tokens, BS, extra_key(cache_salt(SECRET.encode(), tenant)))


def test_index_follows_events_by_medium_and_matches_as_a_replica_does():
    keys = keys_of(list(range(5 * BS)))
    index = BlockIndex()
    index.apply([BlockStored(keys[:3], None, [], BS), BlockStored(keys[3:5], keys[2], [], BS, medium="CPU")])
    run = index.cached_run(keys)
    assert (run.device_blocks, run.tier_blocks) == (3, 2)
    index.apply([BlockRemoved(keys[1:2])])  # a hole in the pool: the device run stops there, the tiers do not go on
    assert index.cached_run(keys).blocks == 1
    index.apply([AllBlocksCleared()])
    assert index.cached_run(keys).blocks == 0 and index.sizes() == {"GPU": 0, "CPU": 2}


def test_fallback_is_bounded_by_capacity_and_evicts_chains_from_their_tails():
    sent = SentBlocks(capacity_blocks=4)
    first, second = keys_of(list(range(3 * BS))), keys_of(list(range(100, 100 + 3 * BS)))
    sent.record(first)
    sent.record(second)
    assert len(sent) == 4
    assert sent.cached_run(second).blocks == 3 and sent.cached_run(first).blocks == 1  # first lost its tail


def _replica(index: int, blocks: list[bytes] = ()) -> Replica:
    info = ServerInfo("m", "m", "/x", BS, 1000, 512, None, False)
    r = Replica(index, f"http://r{index}", State.HEALTHY, info, sent=SentBlocks(1000))
    r.subscriber = type("Sub", (), {"last_event_time": None, "last_seq": 0})()
    r.events.apply([BlockStored(list(blocks), None, [], BS)] if blocks else [])
    return r


async def serve_post(path: str, handler):
    """An aiohttp app answering POST `path` with `handler` on a free loopback port: its runner
    (`cleanup()` stops it) and the port."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_another_tenants_identical_prompt_scores_no_cached_token():
    tokens = list(range(4 * BS + 3))
    holder = _replica(0, keys_of(tokens, "A"))
    for tenant, expected in (("A", 4 * BS), ("B", 0)):
        request = RoutedRequest("completion", {}, tenant, None, [tokens], [keys_of(tokens, tenant)])
        assert score(holder, request, time.monotonic()).predicted_cached_tokens == expected


def test_a_replica_whose_events_stop_is_scored_by_what_the_router_sent_it():
    tokens = list(range(3 * BS + 1))
    keys = keys_of(tokens)
    r = _replica(0)
    r.sent.record(keys)  # sent there, but no event ever says it was stored
    request = RoutedRequest("completion", {}, "A", None, [tokens], [keys])
    now = time.monotonic()
    assert score(r, request, now).predicted_cached_tokens == 0  # events are trusted while they may still come
    r.expect_events(since=now - 1)
    assert score(r, request, now + EVENTS_STALE_AFTER + 1).predicted_cached_tokens == 3 * BS
    r.subscriber.last_event_time = now  # they came after all
    assert score(r, request, now + EVENTS_STALE_AFTER + 2).predicted_cached_tokens == 0


def test_cache_aware_ties_are_broken_by_load_then_by_chance_never_by_order():
    replicas = [_replica(i) for i in range(3)]
    picks = {CacheAware().pick([Decision(r, 0, 10, 10.0, 0.0) for r in replicas]).replica.index for _ in range(200)}
    assert picks == {0, 1, 2}
    loaded = [Decision(r, 0, 10, 10.0, load) for r, load in zip(replicas, (5.0, 1.0, 5.0), strict=True)]
    assert CacheAware().pick(loaded).replica.index == 1


def test_overlap_score_weight_keeps_a_chat_on_its_cache_against_held_kv():
    """Replica 0 caches 4 of the prompt's 6 blocks but runs a request holding 100 tokens more KV than
    replica 1: at weight 1 (Dynamo's default) the 64 cached tokens are worth less than that, at
    kvserve's default (16) more."""
    tokens = list(range(6 * BS + 1))
    keys = keys_of(tokens)
    warm, cold = _replica(0, keys[:4]), _replica(1)
    warm.add_flight(Flight(prompt_tokens=150, uncached_tokens=0, started=True))
    cold.add_flight(Flight(prompt_tokens=50, uncached_tokens=0, started=True))
    request = RoutedRequest("completion", {}, "A", None, [tokens], [keys])
    assert make_policy("cache_aware", 1.0).choose(request, [warm, cold]).replica is cold
    assert make_policy("cache_aware").choose(request, [warm, cold]).replica is warm
    with pytest.raises(ValueError, match="kv-overlap-score-weight"):
        make_policy("cache_aware", 0.0)


def test_queued_prefill_outweighs_a_cached_run():
    """At the default weight a replica's prefill still waiting (requests sent, no token yet) counts as
    much as uncached prompt: its cache does not draw every request while its queue grows."""
    tokens = list(range(6 * BS + 1))
    keys = keys_of(tokens)
    warm, cold = _replica(0, keys[:4]), _replica(1)
    queued = Flight(prompt_tokens=200, uncached_tokens=200)
    warm.add_flight(queued)
    request = RoutedRequest("completion", {}, "A", None, [tokens], [keys])
    assert make_policy("cache_aware").choose(request, [warm, cold]).replica is cold
    queued.started = True  # its prefill is done: only its KV counts now
    assert make_policy("cache_aware").choose(request, [warm, cold]).replica is warm


def test_last_prompt_token_is_never_predicted_cached():
    tokens = list(range(3 * BS))  # exactly three blocks: the replica computes the last token, so two are usable
    r = _replica(0, keys_of(tokens))
    request = RoutedRequest("completion", {}, "A", None, [tokens], [keys_of(tokens)])
    assert score(r, request, time.monotonic()).predicted_cached_tokens == 2 * BS


TEMPLATE_FEATURES = (  # what transformers' environment gives templates: each of these fails in a plain jinja2 one
    "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}{{ raise_exception('no tools') }}{%- endif -%}"
    "{%- if loop.index > 9 %}{% break %}{% endif -%}{%- set ns.n = ns.n + 1 -%}"
    "{{ bos_token }}{{ m['role'] | upper }}: {% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{{ eos_token }}\n{%- endfor -%}{{ {'n': ns.n, 'text': 'é'} | tojson }}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_chat_templates_render_as_transformers_renders_them(tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    mine = RouterTokenizer.from_dir(tiny_model_dir)
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "日本語? ünïcödé 🙂"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b\n\nc"},
            {"role": "user", "content": "d"},
        ],
    ]
    for chat in chats:
        assert mine.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert mine.encode_chat(chat) == hf.encode(mine.render_chat(chat), add_special_tokens=False)
    featured = RouterTokenizer(mine.tokenizer, None, mine.special_tokens)
    from kvserve.router.tokenizer import compile_chat_template

    featured.chat_template = compile_chat_template(TEMPLATE_FEATURES)
    for chat in chats:
        expected = hf.apply_chat_template(
            chat, chat_template=TEMPLATE_FEATURES, tokenize=False, add_generation_prompt=True
        )
        assert featured.render_chat(chat) == expected


PROMPT_IDS = [5, 6, 7]


def _chunk(text: str, ids: list[int], finish: str | None = None, **extra: object) -> str:
    """A completion chunk as a replica streams it with return_token_ids."""
    choice = {"index": 0, "text": text, "token_ids": ids, **extra}
    if finish:
        choice["finish_reason"] = finish
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})


def _progress(tok: RouterTokenizer | None, **body: object) -> StreamProgress:
    body = {"prompt": PROMPT_IDS, "max_tokens": 4, "stream": True, "temperature": 0.8, "seed": 1, **body}
    return StreamProgress(RoutedRequest("completion", body, "A", None, [PROMPT_IDS], [[]]), tok)


def _choices(events: list[str]) -> list[dict]:
    return [c for e in events if e != "[DONE]" for c in json.loads(e)["choices"]]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> RouterTokenizer:
    return RouterTokenizer.from_dir(tiny_model_dir)


def _ids(tok: RouterTokenizer, *pieces: str) -> list[int]:
    vocab = tok.tokenizer.get_vocab()
    return [vocab[p] for p in pieces]


def test_a_cut_between_the_bytes_of_a_character_goes_on_after_both(tok):
    """The replica held back half of 'é' when it died: the continuation's prompt has every token generated (that
    half too), nothing is generated again, and the router decodes the new tokens after the old ones, so the
    other half completes the character the new replica alone could not read."""
    hello, half1, half2, bang = _ids(tok, "Hello", "Ã", "©", "!")
    progress = _progress(tok)
    body = upstream_body(progress.request)
    assert body["return_token_ids"] is True and "logprobs" not in body
    assert _choices(progress.accept(_chunk("Hello", [hello], prompt_token_ids=PROMPT_IDS))) == [
        {"index": 0, "text": "Hello"}
    ]  # the ids the client did not ask for are gone
    assert progress.accept(_chunk("", [half1])) == []  # sent only for its id: nothing for the client
    moved = progress.continuation_body()
    assert moved["prompt"] == [*PROMPT_IDS, hello, half1] and moved["max_tokens"] == 2
    assert moved["return_token_ids"] is True and "logprobs" not in moved and moved["seed"] == 1
    # the new replica's own text of the second half alone is a replacement character: not what the client gets
    (out,) = progress.accept(_chunk("\ufffd", [half2], prompt_token_ids=moved["prompt"]))
    assert json.loads(out)["id"] == "cmpl-1" and json.loads(out)["choices"] == [{"index": 0, "text": "é"}]
    assert _choices(progress.accept(_chunk("!", [bang], "length"))) == [
        {"index": 0, "text": "!", "finish_reason": "length"}
    ]
    assert progress.text == "Helloé!" and progress.token_ids == [hello, half1, half2, bang]
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    progress.wants_usage = True
    (final,) = progress.accept(json.dumps({"id": "x", "choices": [], "usage": usage}))
    assert json.loads(final)["usage"]["prompt_tokens"] == 3 and json.loads(final)["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_begun_before_the_cut_is_the_routers_to_match(tok, include):
    """The replica held back the "o" of "Hello" (it may start the stop string "o w"); the new replica never saw it,
    so the router matches the stop string, cuts the text there and ends the stream itself."""
    hello, world = _ids(tok, "Hello", "Ġworld")
    progress = _progress(tok, stop=["o w"], include_stop_str_in_output=include, stream_options={"include_usage": True})
    assert _choices(progress.accept(_chunk("Hell", [hello]))) == [{"index": 0, "text": "Hell"}]
    moved = progress.continuation_body()
    assert "stop" not in moved and "include_stop_str_in_output" not in moved
    events = progress.accept(_chunk(" world", [world]))
    text = "o w" if include else ""
    assert _choices(events) == [{"index": 0, "text": text, "finish_reason": "stop", "stop_reason": "o w"}]
    assert json.loads(events[1])["usage"]["completion_tokens"] == 2 and events[2] == "[DONE]" and progress.done


def test_held_back_text_that_starts_no_stop_string_reaches_the_client_after_a_cut(tok):
    hello, there, bang = _ids(tok, "Hello", "Ġthere", "!")
    progress = _progress(tok, stop=["o w", "!"])
    progress.accept(_chunk("Hell", [hello]))
    progress.continuation_body()
    assert _choices(progress.accept(_chunk(" there", [there]))) == [{"index": 0, "text": "o there"}]
    events = progress.accept(_chunk("", [bang]))  # "!" is a stop string: the router's to find
    assert _choices(events)[-1] == {"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "!"}
    assert progress.text == "Hello there" and progress.token_ids == [hello, there, bang]


def test_the_ids_and_logprobs_a_client_asked_for_come_through_a_migration_once_each(tok):
    hello, half1, half2 = _ids(tok, "Hello", "Ã", "©")

    def logprobs(token: str, offset: int) -> dict:
        return {"tokens": [token], "token_logprobs": [-1.0], "text_offset": [offset], "top_logprobs": [{token: -1.0}]}

    progress = _progress(tok, return_token_ids=True, logprobs=0)
    first = _chunk("Hello", [hello], prompt_token_ids=PROMPT_IDS, logprobs=logprobs("Hello", 0))
    assert _choices(progress.accept(first))[0]["prompt_token_ids"] == PROMPT_IDS
    (held,) = _choices(progress.accept(_chunk("", [half1], logprobs=logprobs("\ufffd", 5))))
    assert held["token_ids"] == [half1] and held["text"] == ""
    moved = progress.continuation_body()
    assert moved["logprobs"] == 0 and moved["return_token_ids"] is True
    (out,) = _choices(
        progress.accept(_chunk("\ufffd", [half2], prompt_token_ids=moved["prompt"], logprobs=logprobs("\ufffd", 0)))
    )
    assert out["text"] == "é" and out["token_ids"] == [half2] and "prompt_token_ids" not in out
    assert out["logprobs"]["text_offset"] == [6] and out["logprobs"]["tokens"] == ["\ufffd"]


def test_without_a_tokenizer_a_cut_stream_starts_again_and_skips_what_the_client_had():
    """No tokenizer, no decoding: the continuation starts from the original prompt and its first tokens, the same
    ones only under greedy decoding, are skipped with their text."""
    progress = _progress(None, temperature=0, stop=["zz"])
    progress.accept(_chunk("Hello", [11]))
    progress.accept(_chunk("", [12]))
    moved = progress.continuation_body()
    assert moved["prompt"] == PROMPT_IDS and moved["max_tokens"] == 4 and moved["stop"] == ["zz"]
    assert progress.accept(_chunk("Hello", [11])) == [] and progress.accept(_chunk("", [12])) == []
    assert _choices(progress.accept(_chunk("é", [13], "length"))) == [
        {"index": 0, "text": "é", "finish_reason": "length"}
    ]
    assert progress.text == "Helloé" and progress.token_ids == [11, 12, 13]


def test_an_upstream_event_of_hundreds_of_kib_comes_through_whole():
    """A chat stream's first event carries the prompt's token ids: hundreds of KiB for a long
    prompt, more than aiohttp's read buffer (64 KiB) holds at once."""
    from aiohttp import ClientSession, web

    big = json.dumps({"prompt_token_ids": list(range(60_000))})  # ~400 KB
    sent = [big, json.dumps({"choices": []}), "[DONE]"]

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for data in sent:
            for i in range(0, len(data), 50_000):  # an event over several writes, as TCP may cut it
                await response.write(("data: " if i == 0 else "").encode() + data[i : i + 50_000].encode())
            await response.write(b"\r\n\r\n")
        return response

    async def relay() -> list[str]:
        runner, port = await serve_post("/", stream)
        try:
            async with ClientSession() as session:
                response = await session.post(f"http://127.0.0.1:{port}/")
                replica = _replica(0)
                upstream = Upstream(replica, Decision(replica, 0, 0, 0.0, 0.0), response, Flight(0, 0))
                got = [await upstream.next() for _ in sent]
                with pytest.raises(StreamCut):  # then the end of the body
                    await upstream.next()
                return got
        finally:
            await runner.cleanup()

    assert asyncio.run(relay()) == sent


# --- the cluster ----------------------------------------------------------------------------------


@dataclass
class Process:
    cmd: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = self.log_path.open("a")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"{self.cmd[3]} exited while starting: {self.log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{self.url} did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@dataclass
class Cluster:
    replicas: list[Process]
    router: Process
    keys: Path
    victim_prompts: list[dict] = field(default_factory=list)  # requests the killed replica served
    victim: int = 0  # the replica the SIGKILL test killed

    def post(self, path: str, body: dict, key: str = "key-a") -> httpx.Response:
        return httpx.post(f"{self.router.url}{path}", json=body, headers=_auth(key), timeout=60)

    def state(self, router: str | None = None) -> list[dict]:
        url = router or self.router.url
        return httpx.get(f"{url}/router/replicas", headers=_auth("key-a"), timeout=5).json()

    def settle(self, router: str | None = None, timeout: float = 10.0) -> None:
        """Wait until the events of what has run reached the router (no replica's sequence number moves)."""
        deadline, last, still = time.monotonic() + timeout, None, 0
        while time.monotonic() < deadline:
            seqs = [(r["last_seq"], r["in_flight"]) for r in self.state(router)]
            still = still + 1 if seqs == last and all(f == 0 for _, f in seqs) else 0
            if still >= 3:
                return
            last = seqs
            time.sleep(0.1)
        raise AssertionError(f"the router's index did not settle: {self.state(router)}")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def replica_process(model: Path, tmp: Path, i: int, port: int | None = None, events: int | None = None) -> Process:
    port, events = port or free_port(), events or free_port(pair=True)
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", str(model), "--port", str(port), *TINY_ARGS]
    cmd += ["--api-keys", str(tmp / "keys"), "--cache-secret", SECRET, "--kv-events-endpoint", f"tcp://*:{events}"]
    p = Process(cmd, f"http://127.0.0.1:{port}", tmp / f"replica{i}.log")
    p.port, p.events = port, events  # type: ignore[attr-defined]
    return p


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    keys = write_keys(tmp / "keys")
    replicas = [replica_process(tiny_model_dir, tmp, i) for i in range(3)]
    for r in replicas:
        r.start()
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--port", str(port)]
    cmd += [a for r in replicas for a in ("--replica", r.url)] + ["--api-keys", str(keys), "--cache-secret", SECRET]
    router = Process(cmd, f"http://127.0.0.1:{port}", tmp / "router.log")
    c = Cluster(replicas, router, keys)
    try:
        for r in replicas:
            r.wait_healthy()
        router.start()
        router.wait_healthy(timeout=60)
        _wait_until(lambda: all(r["state"] == "healthy" for r in c.state()), 10, "replicas discovered")
        yield c
    finally:
        for p in [router, *replicas]:
            if p.proc is not None:
                p.stop()


def _wait_until(condition, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out waiting for: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def predicted(response: httpx.Response) -> int:
    return int(response.headers["x-kvserve-predicted-cached-tokens"])


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  spaces before, and after  ",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and a zero-width\u200bjoiner",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # comment\r\n",
    "<|im_start|>user\nspecial tokens typed as text<|im_end|>",
    "1234567890 3.14159 -42 1e-9 0xdeadbeef",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Où est la gare? 🚉"}],
    [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer\nwith two lines"},
        {"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text", "text": "joined"}]},
    ],
]


def test_router_tokenizes_exactly_as_the_replicas_do(cluster, tiny_model_dir):
    mine = RouterTokenizer.from_dir(tiny_model_dir)
    replica = cluster.replicas[0].url
    for prompt in PROMPTS:
        theirs = httpx.post(f"{replica}/tokenize", json={"prompt": prompt}, headers=_auth("key-a")).json()["tokens"]
        assert mine.encode(prompt) == theirs, prompt
    for chat in CHATS:
        theirs = httpx.post(f"{replica}/tokenize", json={"messages": chat}, headers=_auth("key-a")).json()["tokens"]
        flat = [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else "\n".join(p["text"] for p in m["content"]),
            }
            for m in chat
        ]
        assert mine.encode_chat(flat) == theirs, chat
    assert "tokenizing locally" in cluster.router.log_path.read_text()


def test_edge_checks_keys_and_a_clients_4xx_never_counts_against_a_replica(cluster):
    assert httpx.post(f"{cluster.router.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert cluster.post("/v1/completions", {"prompt": "x"}, key="nope").status_code == 401
    for _ in range(6):
        response = cluster.post("/v1/completions", {"prompt": "x", "max_tokens": 0})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert cluster.post("/v1/completions", {"prompt": "x", "model": "other"}).status_code == 404
    assert all(r["state"] == "healthy" for r in cluster.state())
    models = httpx.get(f"{cluster.router.url}/v1/models", headers=_auth("key-b")).json()
    assert models["data"][0]["max_model_len"] == 512


def test_the_router_process_never_loads_torch(cluster):
    maps = Path(f"/proc/{cluster.router.proc.pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    assert "libtorch" not in maps.read_text()


def test_a_chats_later_turns_go_to_the_replica_holding_its_history(cluster):
    messages = [
        {"role": "system", "content": "You are a patient tutor who explains things slowly and carefully."},
        {"role": "user", "content": "Explain how a lighthouse lens focuses light, step by step, for a child."},
    ]
    first = None
    for turn in range(4):
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        if turn == 2:  # one turn streamed: same routing, same prediction in the headers
            text, usage, response = _stream_chat(cluster, body)
        else:
            response = cluster.post("/v1/chat/completions", body)
            text, usage = response.json()["choices"][0]["message"]["content"], response.json()["usage"]
        replica = response.headers["x-kvserve-replica"]
        first = first or replica
        assert replica == first, f"turn {turn} went to replica {replica}, its history is on {first}"
        assert predicted(response) == cached(usage)
        if turn:
            assert cached(usage) >= 2 * BS
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then, part {turn}?"}]
        cluster.settle()


def _stream_chat(cluster: Cluster, body: dict) -> tuple[str, dict, httpx.Response]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"{cluster.router.url}/v1/chat/completions", json=body, headers=_auth("key-a")) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text, usage, r


def test_a_second_tenants_identical_prompt_is_not_scored_against_the_first_tenants_blocks(cluster):
    prompt = "A shared document both tenants happen to send: " + " ".join(f"clause {i} applies." for i in range(30))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = cluster.post("/v1/completions", body, key="key-a")
    cluster.settle()
    again = cluster.post("/v1/completions", body, key="key-a")
    assert again.headers["x-kvserve-replica"] == first.headers["x-kvserve-replica"]
    assert predicted(again) == cached(again.json()["usage"]) > 0
    other = cluster.post("/v1/completions", body, key="key-b")
    assert predicted(other) == 0 and cached(other.json()["usage"]) == 0
    cluster.settle()


def test_every_predicted_cached_token_count_equals_the_replicas_report(cluster):
    m = metrics(cluster.router.url)
    predicted_total = sum(v for (name, _), v in m.items() if name == "kvserve:router_predicted_cached_tokens_total")
    reported_total = sum(v for (name, _), v in m.items() if name == "kvserve:router_reported_cached_tokens_total")
    wrong = sum(v for (name, _), v in m.items() if name == "kvserve:router_cached_tokens_mispredicted_total")
    assert predicted_total == reported_total > 0 and wrong == 0
    assert sum(v for (name, _), v in m.items() if name == "kvserve:router_decision_seconds_count") > 0


def test_without_the_tokenizer_files_the_replicas_tokenize_and_predictions_still_hold(cluster):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvserve.entrypoints.cli",
        "router",
        "--port",
        str(port),
        "--tokenizer",
        "/nonexistent",
    ]
    cmd += [a for r in cluster.replicas for a in ("--replica", r.url)]
    cmd += ["--api-keys", str(cluster.keys), "--cache-secret", SECRET]
    remote = Process(cmd, f"http://127.0.0.1:{port}", cluster.router.log_path.with_name("remote-router.log"))
    remote.start()
    try:
        remote.wait_healthy(timeout=60)
        body = {"messages": [{"role": "user", "content": "Remote tokenization, " * 8}], "max_tokens": 3}
        for _ in range(2):
            response = httpx.post(f"{remote.url}/v1/chat/completions", json=body, headers=_auth("key-a"), timeout=60)
            assert response.status_code == 200 and predicted(response) == cached(response.json()["usage"])
            cluster.settle(remote.url)
        assert cached(response.json()["usage"]) > 0
        assert metrics(remote.url)[("kvserve:router_tokenize_fallbacks_total", ())] == 2
    finally:
        remote.stop()
    assert "tokenizing on the replicas" in remote.log_path.read_text()


def _decode(tok: RouterTokenizer, ids: list[int]) -> str:
    """The text of `ids` as a replica's detokenizer writes it (a last half character left out)."""
    detokenizer = IncrementalDetokenizer(tok.tokenizer, skip_special_tokens=True)
    return "".join(detokenizer.step(t) for t in ids)


def _payloads(url: str, path: str, body: dict) -> list[str]:
    """A replica's stream: its `data:` payloads in order."""
    with httpx.stream("POST", f"{url}{path}", json=body, headers=_auth("key-a"), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _ids_in(payloads: list[str]) -> list[int]:
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    return [t for chunk in chunks for c in chunk.get("choices", []) for t in c.get("token_ids", [])]


def _migrated(cluster, progress: StreamProgress, first: list[str], cut: int) -> list[str]:
    """What the client gets when replica 1's stream `first` is cut after `cut` payloads and goes on on replica 2."""
    events = [e for data in first[:cut] for e in progress.accept(data)]
    moved = progress.continuation_body()
    for data in _payloads(cluster.replicas[2].url, "/v1/completions", moved):
        if progress.done:  # the router ended it (a stop string): the proxy closes the upstream here
            break
        events += progress.accept(data)
    assert progress.done and events[-1] == "[DONE]"
    return events


def _request(tok: RouterTokenizer, kind: str, body: dict) -> RoutedRequest:
    prompt = tok.encode_chat(body["messages"]) if kind == "chat" else tok.encode(body["prompt"])
    return RoutedRequest(kind, body, "A", None, [prompt], [[]])


def test_a_client_leaving_a_stream_ends_its_request_on_the_replica(cluster):
    """The router closes its connection to the replica when its client goes, so the replica
    stops generating for no one (an upstream left open would run to max_tokens)."""

    def running(replica: Process) -> int:
        return httpx.get(f"{replica.url}/load", timeout=5).json()["num_requests_running"]

    def generated(replica: Process) -> float:
        return metrics(replica.url)[("kvserve:generation_tokens_total", ())]

    before = [generated(r) for r in cluster.replicas]
    body = {"prompt": "leave early", "max_tokens": 480, "ignore_eos": True, "stream": True, "temperature": 0}
    url = f"{cluster.router.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=_auth("key-a"), timeout=60) as response:
        i = int(response.headers["x-kvserve-replica"])
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert running(cluster.replicas[i]) == 1
    _wait_until(lambda: running(cluster.replicas[i]) == 0, 30.0, "the replica to end the left stream")
    assert generated(cluster.replicas[i]) - before[i] < body["max_tokens"]


def test_a_stop_string_straddling_a_cut_ends_a_real_stream_where_the_uninterrupted_one_ends(cluster, tok):
    """Greedy, so the continuation's next token is the uninterrupted run's: a stop string over the token the
    replica was holding back when cut and the next one ends the stream at the same place, matched by the router."""
    body = {"prompt": "Migrate me at a stop string", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    request = _request(tok, "completion", body)
    ids = _ids_in(_payloads(cluster.replicas[1].url, "/v1/completions", upstream_body(request)))
    texts = [_decode(tok, ids[:k]) for k in range(len(ids) + 1)]  # after k tokens

    def first_seen_over(j: int) -> bool:  # the text of tokens j and j + 1 appears first there
        stop = texts[j + 2][len(texts[j]) :]
        return len(texts[j]) < len(texts[j + 1]) < len(texts[j + 2]) and texts[j + 2].find(stop) == len(texts[j])

    j = next(j for j in range(len(ids) - 1) if first_seen_over(j))
    stop = texts[j + 2][len(texts[j]) :]
    request = _request(tok, "completion", {**body, "stop": [stop]})
    first = _payloads(cluster.replicas[1].url, "/v1/completions", upstream_body(request))
    held = next(i for i, p in enumerate(first) if _ids_in([p]) == [ids[j]])
    assert json.loads(first[held])["choices"][0]["text"] == ""  # token j's text is held back: it may start `stop`
    progress = StreamProgress(request, tok)
    choices = _choices(_migrated(cluster, progress, first, held + 1))
    assert "".join(c["text"] for c in choices) == texts[j] and progress.token_ids == ids[: j + 2]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_sampled_real_stream_cut_anywhere_is_the_text_of_the_tokens_counted(cluster, tok, kind):
    """Sampled (seeded, so replica 1's run is the same each time): cut after any event and continued on replica
    2, the client's text is the text of exactly the tokens it is counted for, the ones before the cut among them;
    the ids it asked for come once each, the prompt's first; a client that did not ask gets none."""
    body = {"max_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Sampled, cut and continued"}]
    else:
        body["prompt"] = "Sampled, cut and continued"
    for asked in (True, False):
        request = _request(tok, kind, {**body, "return_token_ids": True} if asked else body)
        first = _payloads(cluster.replicas[1].url, PATHS[kind], upstream_body(request))
        for cut in range(1, len(first) - 2, 4):  # the last two: usage, [DONE]
            progress = StreamProgress(request, tok)
            events = _migrated(cluster, progress, first, cut)
            choices = _choices(events)
            text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
            ids = progress.token_ids
            assert ids[: len(_ids_in(first[:cut]))] == _ids_in(first[:cut]) and len(ids) == 24
            assert text == _decode(tok, ids), (kind, asked, cut)
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 24
            assert json.loads(events[-2])["usage"]["prompt_tokens"] == len(request.prompts[0])
            if not asked:
                assert all("token_ids" not in e and "prompt_token_ids" not in e for e in events)
                continue
            assert [t for c in choices for t in c.get("token_ids", [])] == ids
            chunks = [json.loads(e) for e in events[:-1]]
            prompt_ids = [
                c["prompt_token_ids"] for c in (chunks if kind == "chat" else choices) if "prompt_token_ids" in c
            ]
            assert prompt_ids == [request.prompts[0]]


STREAMS = 64
MAX_TOKENS = 32


def _sampled(i: int) -> bool:
    """Half the streams are sampled (seeded) and ask for their token ids, chats and completions alike."""
    return i % 4 >= 2


def _stream_body(i: int) -> tuple[str, dict]:
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    common["stream_options"] = {"include_usage": True}
    if _sampled(i):
        common.update(temperature=1.0, seed=i, return_token_ids=True)
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell story {i}, please."}]}
    return "/v1/completions", {**common, "prompt": f"Story number {i}: once upon a time, in a town by the sea,"}


@dataclass
class StreamResult:
    index: int = -1  # which of the STREAMS
    replica: int = -1
    text: str = ""
    chunks: int = 0
    usage: dict | None = None
    finish: str | None = None
    errors: list = field(default_factory=list)
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # each time they came


async def _run_streams(url: str, on_chunk=None) -> list[StreamResult]:
    async def one(client: httpx.AsyncClient, i: int) -> StreamResult:
        path, body = _stream_body(i)
        result = StreamResult(index=i)
        async with client.stream("POST", f"{url}{path}", json=body, headers=_auth("key-a")) as r:
            assert r.status_code == 200, await r.aread()
            result.replica = int(r.headers["x-kvserve-replica"])
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.errors.append(chunk["error"])
                    continue
                result.usage = chunk.get("usage") or result.usage
                result.prompt_token_ids += [p for p in [chunk.get("prompt_token_ids")] if p is not None]
                for c in chunk["choices"]:
                    result.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    result.finish = c.get("finish_reason") or result.finish
                    result.token_ids += c.get("token_ids", [])
                    result.prompt_token_ids += [p for p in [c.get("prompt_token_ids")] if p is not None]
                result.chunks += 1
                if on_chunk is not None:
                    on_chunk(result)
        return result

    limits = httpx.Limits(max_connections=STREAMS * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))


def test_sigkill_of_a_replica_during_64_streams_fails_no_request(cluster, tok):
    """Greedy streams come out as their uninterrupted runs; sampled ones, which sample anew after a cut, as the
    text of exactly their token ids: nothing the client had is repeated or lost."""
    reference = asyncio.run(_run_streams(cluster.router.url))
    assert all(r.done and not r.errors and r.usage["completion_tokens"] == MAX_TOKENS for r in reference)
    cluster.settle()
    cut_at: dict[int, int] = {}  # stream -> chunks it had when its replica died
    killed: list[float] = []
    dead_after: list[float] = []

    def watch() -> None:  # how long the router takes to stop routing to it
        dead_after.append(_wait_until(lambda: cluster.state()[cluster.victim]["state"] == "dead", 2.0, "marked dead"))

    def on_chunk(result: StreamResult) -> None:
        # the replica of a sampled stream 10 chunks in (the policy decides where the streams go)
        if not killed and _sampled(result.index) and result.chunks >= 10:
            cluster.victim = result.replica
            cluster.replicas[cluster.victim].proc.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())
            threading.Thread(target=watch, daemon=True).start()

    results = asyncio.run(_run_streams(cluster.router.url, on_chunk))
    victim = cluster.victim
    assert killed, "no stream reached the victim replica"
    _wait_until(lambda: bool(dead_after), 3.0, "the watcher")
    assert dead_after[0] < 2.0
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert got.done and not got.errors, f"stream {i}: {got.errors}"
        assert got.finish == "length" and got.usage["completion_tokens"] == MAX_TOKENS
        assert got.usage["prompt_tokens"] == ref.usage["prompt_tokens"]
        if not _sampled(i):
            assert got.text == ref.text, f"stream {i} (replica {got.replica}) differs from its uninterrupted run"
            assert not got.token_ids and not got.prompt_token_ids
        else:
            assert len(got.token_ids) == MAX_TOKENS and got.text == _decode(tok, got.token_ids), f"stream {i}"
            assert got.prompt_token_ids == ref.prompt_token_ids and len(ref.prompt_token_ids) == 1
        if got.replica == victim:
            cut_at[i] = got.chunks
            cluster.victim_prompts.append(_stream_body(i))
    m = metrics(cluster.router.url)
    migrated = m[("kvserve:router_migrations_total", (("result", "ok"),))]
    assert migrated >= 1 and cut_at, "no stream was cut mid-way"
    assert any(_sampled(i) for i in cut_at), "no sampled stream was on the killed replica"
    after = cluster.post("/v1/completions", {"prompt": "after the kill", "max_tokens": 2})
    assert after.status_code == 200 and after.headers["x-kvserve-replica"] != str(victim)


def test_a_replica_restarted_empty_is_indexed_from_scratch(cluster, tiny_model_dir):
    if not cluster.victim_prompts:
        pytest.skip("follows the SIGKILL test")
    v = cluster.victim
    old = cluster.replicas[v]
    old.stop()
    tmp = old.log_path.parent
    restarted = replica_process(tiny_model_dir, tmp, v, port=old.port, events=old.events)
    restarted.start()
    cluster.replicas[v] = restarted
    restarted.wait_healthy()
    _wait_until(lambda: cluster.state()[v]["state"] == "healthy", 5, "the restarted replica discovered")
    state = cluster.state()[v]
    assert state["indexed_blocks"] == {"GPU": 0} and state["sent_blocks"] == 0 and state["events"] == "fresh"
    for path, body in cluster.victim_prompts[:6]:  # cached on it before: now only where migrations went
        whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        response = cluster.post(path, {**whole, "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert predicted(response) == cached(response.json()["usage"]), response.headers
        cluster.settle()


def test_requests_not_yet_answered_are_retried_elsewhere(cluster):
    """A replica that stops answering (SIGSTOP: connections hang, health checks time out) is dead within 2 s;
    the requests it was holding, none answered yet, are sent to the others and all succeed."""
    frozen = cluster.replicas[0]
    retries = "kvserve:router_retries_total", (("reason", "replica_dead"),)
    before = metrics(cluster.router.url).get(retries, 0)
    dead_after: list[float] = []
    watcher = threading.Thread(
        target=lambda: dead_after.append(_wait_until(lambda: cluster.state()[0]["state"] == "dead", 2.0, "dead"))
    )
    frozen.proc.send_signal(signal.SIGSTOP)
    watcher.start()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url, body = f"{cluster.router.url}/v1/completions", {"max_tokens": 2, "temperature": 0}
            sends = [client.post(url, json={**body, "prompt": f"burst {i}"}, headers=_auth("key-a")) for i in range(30)]
            return await asyncio.gather(*sends)

    try:
        responses = asyncio.run(burst())
        watcher.join()
    finally:
        frozen.proc.send_signal(signal.SIGKILL)
        frozen.proc.send_signal(signal.SIGCONT)
    assert dead_after and dead_after[0] < 2.0, "the frozen replica was not marked dead within 2 s"
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert all(r.headers["x-kvserve-replica"] != "0" for r in responses)
    assert metrics(cluster.router.url)[retries] > before


def test_short_prompts_are_tokenized_on_the_loop_and_long_ones_on_a_thread(tiny_model_dir, monkeypatch):
    """A thread hop for a short prompt waits for the GIL behind the relayed streams: only long ones take it."""
    tokenizer = RouterTokenizer.from_dir(tiny_model_dir)
    hops = []

    async def to_thread(fn, *args):
        hops.append(getattr(fn, "func", fn).__name__)  # a partial: the method it binds
        return fn(*args)

    monkeypatch.setattr(request_module.asyncio, "to_thread", to_thread)
    tokenization = Tokenization(tokenizer=tokenizer, local=True)
    short, long = "hello " * 10, "hello " * (request_module.INLINE_TOKENIZE_CHARS // 6 + 1)
    for text in (short, long):
        got = asyncio.run(tokenization.prompts("completion", {"prompt": text}, None))
        assert got == [tokenizer.encode(text)]
        chat = [{"role": "user", "content": text}]
        got = asyncio.run(tokenization.prompts("chat", {"messages": chat}, None))
        assert got == [tokenizer.encode_chat(chat)]
    assert hops == ["encode", "encode_chat"]  # the long prompt's, in both forms
