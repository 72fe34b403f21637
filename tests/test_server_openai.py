"""The server through the official `openai` SDK: completions, chat, streaming, n, logprobs, seeds, stops, usage."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server_common import TINY_ARGS, ServerThread

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir, "--served-model-name", "tiny", *TINY_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="hello world", **GREEDY)
    (c,) = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert c.text and c.finish_reason == "length" and c.index == 0
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 2
    assert r.usage.total_tokens == 10


def test_completion_defaults_to_16_tokens(client):
    r = client.completions.create(model="tiny", prompt="hi", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    (c,) = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content
    assert c.finish_reason == "length" and r.usage.completion_tokens == 8
    tokenized = httpx.post(
        f"{client.base_url}".removesuffix("/v1/") + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert r.usage.prompt_tokens == tokenized["count"]


def test_streaming_completion_matches_whole(client):
    whole = client.completions.create(model="tiny", prompt="stream me", **GREEDY)
    chunks = list(
        client.completions.create(
            model="tiny", prompt="stream me", stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "tell me"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(client):
    r = client.completions.create(
        model="tiny", prompt="pick", n=3, temperature=1.0, seed=3, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18 and len({c.text for c in r.choices}) > 1


def test_n_choices_streamed(client):
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], n=3, stream=True, **GREEDY
    )
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and len(set(texts.values())) == 1  # greedy: all the same


def test_list_of_prompts_gives_one_choice_set_each(client):
    r = client.completions.create(model="tiny", prompt=["first", "second prompt"], n=2, **GREEDY)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    alone = client.completions.create(model="tiny", prompt="second prompt", **GREEDY).choices[0].text
    assert by_index[2] == alone
    assert r.usage.prompt_tokens == 1 + 2 and r.usage.completion_tokens == 4 * 8


def test_token_id_prompt_and_echo(client):
    ids = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize", json={"prompt": "echo this"}).json()
    by_text = client.completions.create(model="tiny", prompt="echo this", echo=True, **GREEDY).choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=ids["tokens"], echo=True, **GREEDY).choices[0].text
    assert by_text == by_ids and by_text.startswith("echo this") and len(by_text) > len("echo this")


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="probabilities", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the most likely
        assert logprob <= 0 and 1 <= len(top) <= 3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "q"}], logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_streamed_logprobs_match_whole(client):
    args = dict(model="tiny", prompt="probabilities", logprobs=1, **GREEDY)
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **args))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == whole.text_offset


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model="tiny",
                prompt="random",
                temperature=1.0,
                seed=seed,
                max_tokens=12,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string(client):
    free = client.completions.create(model="tiny", prompt="stop here", **GREEDY).choices[0].text
    stop = free[4:7]
    c = client.completions.create(model="tiny", prompt="stop here", stop=[stop], **GREEDY).choices[0]
    assert c.finish_reason == "stop" and c.text == free[: free.index(stop)]
    streamed = client.completions.create(model="tiny", prompt="stop here", stop=stop, stream=True, **GREEDY)
    assert "".join(ch.choices[0].text for ch in streamed) == c.text


def test_repeated_prompt_is_cached(client):
    prompt = "a long shared preamble that fills several blocks " * 6
    first = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    second = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_models_version_and_tokenizer_routes(server, client):
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.max_model_len == 512
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "round trip"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "round trip"}


def test_openapi_lists_the_routes(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/load",
        "/metrics",
        "/version",
    ):
        assert path in paths


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    with ServerThread(smollm2_dir, "--served-model-name", "smollm2", "--kv-cache-memory", "64MiB") as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_smollm2_chat(smol):
    r = smol.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in r.choices[0].message.content


@pytest.mark.slow
def test_smollm2_streaming_chat(smol):
    args = dict(
        model="smollm2", messages=[{"role": "user", "content": "Count from 1 to 5."}], temperature=0, max_tokens=32
    )
    whole = smol.chat.completions.create(**args).choices[0].message.content
    chunks = list(smol.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole and all(str(i) in text for i in range(1, 6))
    assert chunks[-1].usage.completion_tokens > 1


def test_server_prefills_in_smaller_chunks_than_offline_unless_told():
    from kvserve.config import EngineConfig
    from kvserve.entrypoints.cli import build_parser, engine_config
    from kvserve.server.args import SERVER_MAX_NUM_BATCHED_TOKENS

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).max_num_batched_tokens == SERVER_MAX_NUM_BATCHED_TOKENS
    assert SERVER_MAX_NUM_BATCHED_TOKENS < EngineConfig().max_num_batched_tokens
    assert engine_config(parse(["serve", "--max-num-batched-tokens", "2048"])).max_num_batched_tokens == 2048
    assert engine_config(parse(["generate", "hi"])).max_num_batched_tokens == EngineConfig().max_num_batched_tokens
