"""vLLM's `return_token_ids`: the prompt's ids and each choice's generated ids beside the text.

Whole responses: completions put `prompt_token_ids` and `token_ids` in each choice; chat puts
`prompt_token_ids` at the top and `token_ids` in each choice. Streams: the prompt's ids come
once (a completion choice's first chunk, chat's role chunk), and each chunk carries the ids
generated since the last one, sent when generated even while their text is held back (a
possible stop string); a stop string's tokens are in the ids though its text is cut. Without
the field, none of these keys appear. The server runs with --strict-fields: the field is known.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_common import TINY_ARGS, ServerThread
from transformers import AutoTokenizer

from kvserve.detokenizer import IncrementalDetokenizer

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Tell me about ids, café 🙂"}]
ID_KEYS = {"prompt_token_ids", "token_ids"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir, "--strict-fields", *TINY_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def decode(tok, ids: list[int]) -> str:
    """The text of `ids` as the detokenizer writes it, a token at a time (a last half character left out)."""
    detokenizer = IncrementalDetokenizer(tok.backend_tokenizer, skip_special_tokens=True)
    return "".join(detokenizer.step(t) for t in ids)


def chat_prompt_ids(tok) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks and all("error" not in c for c in chunks), chunks
    return chunks


def keys_anywhere(value: object) -> set[str]:
    if isinstance(value, dict):
        return set(value) | set().union(*(keys_anywhere(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys_anywhere(v) for v in value))
    return set()


def test_whole_completion_has_the_prompts_and_the_generated_ids(server, tok):
    prompt = "Token ids of a naïve prompt"
    r = post(server, "/v1/completions", {"prompt": prompt, "return_token_ids": True, **GREEDY})
    (c,) = r["choices"]
    assert c["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    assert len(c["token_ids"]) == r["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert decode(tok, c["token_ids"]) == c["text"]
    assert r["usage"]["prompt_tokens"] == len(c["prompt_token_ids"])
    plain = post(server, "/v1/completions", {"prompt": prompt, **GREEDY})
    assert plain["choices"][0]["text"] == c["text"] and not keys_anywhere(plain) & ID_KEYS


def test_whole_chat_has_the_prompts_ids_at_the_top(server, tok):
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True, **GREEDY})
    (c,) = r["choices"]
    assert r["prompt_token_ids"] == chat_prompt_ids(tok) and "prompt_token_ids" not in c
    assert len(c["token_ids"]) == GREEDY["max_tokens"] and decode(tok, c["token_ids"]) == c["message"]["content"]
    plain = post(server, "/v1/chat/completions", {"messages": MESSAGES, **GREEDY})
    assert not keys_anywhere(plain) & ID_KEYS


def test_streamed_completion_sends_the_prompts_ids_once_and_each_chunks_new_ids(server, tok):
    prompt = "Streamed ids"
    body = {"prompt": prompt, "return_token_ids": True, "stream_options": {"include_usage": True}, **GREEDY}
    chunks = stream(server, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    assert all("prompt_token_ids" not in c for c in choices[1:])
    ids = [t for c in choices for t in c["token_ids"]]
    whole = post(server, "/v1/completions", {"prompt": prompt, "return_token_ids": True, **GREEDY})
    assert ids == whole["choices"][0]["token_ids"] and len(ids) == chunks[-1]["usage"]["completion_tokens"]
    assert "".join(c["text"] for c in choices) == decode(tok, ids)
    plain = stream(server, "/v1/completions", {"prompt": prompt, **GREEDY})
    assert not keys_anywhere(plain) & ID_KEYS


def test_streamed_chat_sends_the_prompts_ids_in_the_role_chunk(server, tok):
    chunks = stream(server, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True, **GREEDY})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and "token_ids" not in chunks[0]["choices"][0]
    assert chunks[0]["prompt_token_ids"] == chat_prompt_ids(tok)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert len(ids) == GREEDY["max_tokens"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == decode(tok, ids)
    plain = stream(server, "/v1/chat/completions", {"messages": MESSAGES, **GREEDY})
    assert not keys_anywhere(plain) & ID_KEYS


def test_sampled_choices_each_carry_their_own_ids(server, tok):
    body = {"prompt": "Sampled", "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 10, "ignore_eos": True}
    chunks = stream(server, "/v1/completions", {**body, "return_token_ids": True})
    texts, ids, prompts = {}, {}, {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            ids[c["index"]] = ids.get(c["index"], []) + c["token_ids"]
            if "prompt_token_ids" in c:
                assert c["index"] not in prompts
                prompts[c["index"]] = c["prompt_token_ids"]
    assert sorted(prompts) == [0, 1, 2] and all(
        p == tok.encode("Sampled", add_special_tokens=False) for p in prompts.values()
    )
    assert all(len(ids[i]) == 10 and decode(tok, ids[i]) == texts[i] for i in range(3))
    assert len({tuple(v) for v in ids.values()}) > 1


def test_held_back_and_stop_string_tokens_are_sent_with_their_ids(server, tok):
    """A stop string over two tokens: the first one's text is held back (it may start the stop string), yet its
    id goes out in its own chunk; the stop's text is cut but both its tokens are in the ids, as in vLLM."""
    prompt, greedy = "Stop strings and ids", {**GREEDY, "max_tokens": 24}
    ids = post(server, "/v1/completions", {"prompt": prompt, "return_token_ids": True, **greedy})["choices"][0]
    ids = ids["token_ids"]
    texts = [decode(tok, ids[:k]) for k in range(len(ids) + 1)]  # the text after k tokens

    def first_found_at_token(j: int) -> bool:  # the text of tokens j and j + 1, first seen there
        stop = texts[j + 2][len(texts[j]) :]
        return len(texts[j]) < len(texts[j + 1]) < len(texts[j + 2]) and texts[j + 2].find(stop) == len(texts[j])

    j = next(j for j in range(len(ids) - 1) if first_found_at_token(j) and "\ufffd" not in texts[j + 2])
    stop = texts[j + 2][len(texts[j]) :]
    body = {"prompt": prompt, "stop": [stop], "return_token_ids": True, **greedy}
    whole = post(server, "/v1/completions", body)["choices"][0]
    assert whole["text"] == texts[j] and whole["token_ids"] == ids[: j + 2] and whole["stop_reason"] == stop
    choices = [c["choices"][0] for c in stream(server, "/v1/completions", body)]
    assert [t for c in choices for t in c["token_ids"]] == ids[: j + 2]
    assert "".join(c["text"] for c in choices) == texts[j]
    assert choices[-2]["token_ids"] == [ids[j]] and choices[-2]["text"] == "" and "finish_reason" not in choices[-2]
    assert choices[-1]["token_ids"] == [ids[j + 1]] and choices[-1]["finish_reason"] == "stop"


def test_strict_fields_still_refuses_unknown_fields(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "return_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_tokens"
