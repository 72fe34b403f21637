"""Beam search through the server: `use_beam_search` with `n` as the beam width (vLLM's extra
parameter), `length_penalty`, `early_stopping`; the same beams as `LLM.beam_search`; clear 400s."""

from __future__ import annotations

import httpx
import pytest
from test_server_common import TINY_ARGS, ServerThread, error_of

from kvserve import LLM
from kvserve.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir, "--served-model-name", "tiny", "--max-num-seqs", "8", *TINY_ARGS) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def test_completions_return_the_beams_of_llm_beam_search(server, tiny_model_dir):
    body = {"prompt": "hello world", "use_beam_search": True, "n": 3, "max_tokens": 6}
    r = post(server, "/v1/completions", {**body, "length_penalty": 0.5, "early_stopping": "never"})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)
    (want,) = llm.beam_search("hello world", BeamSearchParams(3, 6, length_penalty=0.5, early_stopping="never"))
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [s.text for s in want.sequences]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 3 * 6
    two = post(server, "/v1/completions", {**body, "prompt": ["hello world", "bye"]}).json()["choices"]
    assert [c["index"] for c in two] == list(range(6))


def test_chat_with_beam_search(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] <= 8


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"seed": 1}, "seed"),
        ({"logprobs": 0}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": -3.3e16}, "length_penalty"),  # found by the fuzzer: the engine crashed on it
        ({"n": 9}, "n"),  # beam width above max_num_seqs
    ],
)
def test_bad_beam_search_requests_are_400(server, extra, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_neutral_sampling_fields_are_accepted(server):
    body = {"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": 2, "temperature": 0, "top_k": -1}
    assert post(server, "/v1/completions", body).status_code == 200
