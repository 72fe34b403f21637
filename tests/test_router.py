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
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from test_server_common import TINY_ARGS, metrics, write_keys

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.router.index import BlockIndex, SentBlocks
from kvserve.router.migration import StreamProgress
from kvserve.router.policy import CacheAware, Decision, score
from kvserve.router.replicas import EVENTS_STALE_AFTER, Replica, ServerInfo, State
from kvserve.router.request import RoutedRequest
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


def _completion_chunk(token: str, text: str, finish: str | None = None) -> str:
    choice = {"index": 0, "text": text, "logprobs": {"tokens": [token], "token_logprobs": [-1.0], "text_offset": [0]}}
    choice["logprobs"]["top_logprobs"] = [{token: -1.0}]
    if finish:
        choice["finish_reason"] = finish
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]})


def test_a_cut_stream_resumes_after_the_last_whole_character(tiny_model_dir):
    """The replica held back half of 'é' when it died: the continuation starts before that half, skips nothing
    the client saw, and the client's text and token count come out whole."""
    tok = RouterTokenizer.from_dir(tiny_model_dir)
    vocab = tok.tokenizer.get_vocab()
    hello, half1, half2 = vocab["Hello"], vocab["Ã"], vocab["©"]  # "é" as two byte tokens
    body = {"prompt": [5, 6, 7], "max_tokens": 10, "stream": True, "temperature": 0}
    progress = StreamProgress(RoutedRequest("completion", body, "A", None, [[5, 6, 7]], [[]]), tok)
    assert progress.accept(_completion_chunk("Hello", "Hello")) is not None
    assert progress.accept(_completion_chunk("\ufffd", "")) is None  # the client asked no logprobs: nothing to send
    moved = progress.continuation_body()
    assert moved["prompt"] == [5, 6, 7, hello] and moved["max_tokens"] == 9 and moved["logprobs"] == 0
    # the new replica generates the held token again, then the rest
    assert progress.accept(_completion_chunk("\ufffd", "")) is None
    out = json.loads(progress.accept(_completion_chunk("\ufffd", "é")))
    assert out["id"] == "cmpl-1" and out["choices"][0]["text"] == "é" and "logprobs" not in out["choices"][0]
    assert progress.text == "Helloé" and progress.token_ids == [hello, None, None]
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    progress.wants_usage = True
    final = json.loads(progress.accept(json.dumps({"id": "x", "choices": [], "usage": usage})))
    assert final["usage"]["prompt_tokens"] == 3 and final["usage"]["completion_tokens"] == 3
    assert tok.decoded_texts([hello, half1, half2], True) == ["Hello", "", "é"]


# --- the cluster ----------------------------------------------------------------------------------


def free_port(pair: bool = False) -> int:
    """A free port (and, with `pair`, the next one free too: a replica's events and their replay)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


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


STREAMS = 64
MAX_TOKENS = 32


def _stream_body(i: int) -> tuple[str, dict]:
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    common["stream_options"] = {"include_usage": True}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell story {i}, please."}]}
    return "/v1/completions", {**common, "prompt": f"Story number {i}: once upon a time, in a town by the sea,"}


@dataclass
class StreamResult:
    replica: int = -1
    text: str = ""
    chunks: int = 0
    usage: dict | None = None
    finish: str | None = None
    errors: list = field(default_factory=list)
    done: bool = False


async def _run_streams(url: str, on_chunk=None) -> list[StreamResult]:
    async def one(client: httpx.AsyncClient, i: int) -> StreamResult:
        path, body = _stream_body(i)
        result = StreamResult()
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
                for c in chunk["choices"]:
                    result.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    result.finish = c.get("finish_reason") or result.finish
                result.chunks += 1
                if on_chunk is not None:
                    on_chunk(result)
        return result

    limits = httpx.Limits(max_connections=STREAMS * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))


def test_sigkill_of_a_replica_during_64_streams_fails_no_request(cluster):
    reference = asyncio.run(_run_streams(cluster.router.url))
    assert all(r.done and not r.errors and r.usage["completion_tokens"] == MAX_TOKENS for r in reference)
    cluster.settle()
    victim = 0
    cut_at: dict[int, int] = {}  # stream -> chunks it had when its replica died
    killed: list[float] = []
    dead_after: list[float] = []

    def watch() -> None:  # how long the router takes to stop routing to it
        dead_after.append(_wait_until(lambda: cluster.state()[victim]["state"] == "dead", 2.0, "marked dead"))

    def on_chunk(result: StreamResult) -> None:
        if not killed and result.replica == victim and result.chunks >= 10:
            cluster.replicas[victim].proc.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())
            threading.Thread(target=watch, daemon=True).start()

    results = asyncio.run(_run_streams(cluster.router.url, on_chunk))
    assert killed, "no stream reached the victim replica"
    _wait_until(lambda: bool(dead_after), 3.0, "the watcher")
    assert dead_after[0] < 2.0
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert got.done and not got.errors, f"stream {i}: {got.errors}"
        assert got.finish == "length" and got.usage["completion_tokens"] == MAX_TOKENS
        assert got.usage["prompt_tokens"] == ref.usage["prompt_tokens"]
        assert got.text == ref.text, f"stream {i} (replica {got.replica}) differs from its uninterrupted run"
        if got.replica == victim:
            cut_at[i] = got.chunks
            cluster.victim_prompts.append(_stream_body(i))
    m = metrics(cluster.router.url)
    migrated = m[("kvserve:router_migrations_total", (("result", "ok"),))]
    assert migrated >= 1 and cut_at, "no stream was cut mid-way"
    after = cluster.post("/v1/completions", {"prompt": "after the kill", "max_tokens": 2})
    assert after.status_code == 200 and after.headers["x-kvserve-replica"] != str(victim)


def test_a_replica_restarted_empty_is_indexed_from_scratch(cluster, tiny_model_dir):
    if not cluster.victim_prompts:
        pytest.skip("follows the SIGKILL test")
    old = cluster.replicas[0]
    old.stop()
    tmp = old.log_path.parent
    restarted = replica_process(tiny_model_dir, tmp, 0, port=old.port, events=old.events)
    restarted.start()
    cluster.replicas[0] = restarted
    restarted.wait_healthy()
    _wait_until(lambda: cluster.state()[0]["state"] == "healthy", 5, "the restarted replica discovered")
    state = cluster.state()[0]
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
