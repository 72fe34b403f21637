"""Bad input gets a 4xx with an OpenAI error body, never a 5xx; a full queue gets 429 with Retry-After."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from test_server_common import ServerThread, error_of, metrics, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # a short context and few sequences keep whatever the fuzzer sends quick to serve
    args = [
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
    ]
    with ServerThread(tiny_model_dir, *args) as s:
        yield s


def post(server, path: str, body: object = None, content: bytes | None = None, headers=None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, timeout=30, headers={**AUTH, **(headers or {})})


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 10**6}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
        (COMPLETIONS, {"prompt": "x", "seed": 2**70}, "seed"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop.0"),
        (COMPLETIONS, {"prompt": "x", "stop": 5}, "stop"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 only with echo
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0, "echo": True, "n": 2, "use_beam_search": True}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [1, -1]}, "prompt.1"),
        (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2**50], "echo": True}, "prompt"),  # echo decodes only accepted ids
        (COMPLETIONS, {"prompt": 42}, "prompt"),
        (COMPLETIONS, {"prompt": "word " * 100}, "prompt"),  # longer than the context
        (COMPLETIONS, {"prompt": "word " * 50, "max_tokens": 30}, "max_tokens"),
        (COMPLETIONS, {}, "prompt"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages.0.content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
        (CHAT, {"messages": [{"role": "user", "content": "hi " * 100}]}, "messages"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": 2}, "logprobs"),
        (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": "hi"}, "messages"),
        ("/tokenize", {"prompt": 5}, None),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_invalid_field_is_400_naming_it(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "content, headers",
    [
        (b'{"prompt": "x", ', {"content-type": "application/json"}),
        (b"not json at all", {"content-type": "application/json"}),
        (b'{"prompt": "\xff\xfe invalid utf-8"}', {"content-type": "application/json"}),
        (b"[1, 2, 3]", {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
        (b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}),
    ],
)
def test_unparseable_body_is_400(server, content, headers):
    r = post(server, COMPLETIONS, content=content, headers=headers)
    assert r.status_code == 400, r.text
    error_of(r)


def test_megabyte_prompt_is_400_with_the_numbers_and_does_not_block(server):
    """Tokenizing 1 MB takes a while, off the event loop: /health keeps answering meanwhile."""
    replies = []
    big = threading.Thread(
        target=lambda: replies.append(post(server, COMPLETIONS, {"prompt": "lorem ipsum " * 90_000}))
    )
    big.start()
    latencies = []
    while big.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health").status_code == 200
        latencies.append(time.monotonic() - start)
    (r,) = replies
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == "prompt" and "max_model_len=64" in err["message"]
    assert max(latencies) < 1.0


def test_body_over_the_cap_is_413(server):
    big = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()
    for headers in (
        {"content-type": "application/json"},
        {"content-type": "application/json", "transfer-encoding": "chunked"},
    ):
        body = (
            big if "transfer-encoding" not in headers else iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
        )
        r = httpx.post(server.url + COMPLETIONS, content=body, headers={**AUTH, **headers}, timeout=30)
        assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_unknown_fields_are_ignored_by_default(server):
    """As in vLLM: routers add fields of their own (`--strict-fields` refuses them, tests/test_kv_events.py)."""
    body = {"prompt": "x", "max_tokens": 1, "logit_bias": {"1": 5}, "stream_options": None, "sglang_rid": "r1"}
    assert post(server, COMPLETIONS, body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi", "reasoning_content": "z"}], "max_tokens": 1}
    assert post(server, CHAT, chat).status_code == 200


def test_unknown_model_is_404(server):
    for path, body in [(COMPLETIONS, {"prompt": "x", "model": "gpt-4"}), (CHAT, {"messages": USER, "model": "x"})]:
        r = post(server, path, body)
        assert r.status_code == 404
        assert error_of(r)["code"] == "model_not_found"
    assert post(server, COMPLETIONS, {"prompt": "x", "model": "tiny", "max_tokens": 1}).status_code == 200


def test_unexpected_error_is_500_and_the_server_keeps_serving(server, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    serving = server.server.config.app.state.openai_serving_completion
    monkeypatch.setattr(serving, "create_completion", broken)
    r = post(server, COMPLETIONS, {"prompt": "x"})
    assert r.status_code == 500 and error_of(r)["type"] == "server_error"
    monkeypatch.undo()
    assert post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_server_still_serves_after_bad_input(server):
    r = post(server, COMPLETIONS, {"prompt": "fine", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_idle(server.url)


OPERATIONS = [
    (COMPLETIONS, "POST"),
    (CHAT, "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
]
FIXED = [  # positive only
    ("/health", "GET"),
    ("/load", "GET"),
    ("/metrics", "GET"),
    ("/version", "GET"),
    ("/debug/kv_state", "GET"),
]


@pytest.mark.parametrize(
    "path, method, mode",
    [(p, m, mode) for p, m in OPERATIONS for mode in GenerationMode]
    + [(p, m, GenerationMode.POSITIVE) for p, m in FIXED],
)
def test_fuzzed_requests_never_get_a_5xx(server, path, method, mode):
    """Requests generated from /openapi.json: valid ones and schema-violating ones.

    Every default check runs but one: a request the schema allows may still be refused
    with 400 for what no schema can say (a prompt longer than the context, n above
    max_num_seqs, fields that exclude each other).
    """
    operation = schemathesis.openapi.from_url(f"{server.url}/openapi.json")[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance], timeout=60)

    check()
    wait_idle(server.url)


def test_full_queue_is_429_with_retry_after(tiny_model_dir):
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-queued-requests", "1"]
    with ServerThread(tiny_model_dir, *args) as s:
        gate = threading.Event()
        s.engine.on_step.append(lambda outputs: gate.wait())  # holds the engine after each step
        results = []

        def send(prompt: str) -> threading.Thread:
            body = {"prompt": prompt, "max_tokens": 3}
            t = threading.Thread(target=lambda: results.append(httpx.post(s.url + COMPLETIONS, json=body, timeout=60)))
            t.start()
            return t

        def wait_for(name: str) -> None:
            while metrics(s.url)[(f"kvserve:{name}", ())] < 1:
                time.sleep(0.01)

        running = send("runs")
        wait_for("num_requests_running")
        queued = send("waits")
        wait_for("num_requests_waiting")
        r = httpx.post(s.url + COMPLETIONS, json={"prompt": "one too many"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert error_of(r)["type"] == "rate_limit_error"
        gate.set()
        running.join()
        queued.join()
        assert [r.status_code for r in results] == [200, 200]
        wait_idle(s.url)
