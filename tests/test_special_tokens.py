"""A text prompt gets the tokenizer's special tokens (a <bos>, as Gemma's tokenizer adds), as in
vLLM: offline, on /v1/completions and /tokenize unless `add_special_tokens` is false, in the router's
own tokenization too. Chat messages get none on top of the template's unless asked. SmolLM2's
tokenizer adds nothing, so here its copy is given a <bos> post-processor."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from test_server_common import TINY_ARGS, ServerThread
from transformers import AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.router.request import Tokenization
from kvserve.router.tokenizer import RouterTokenizer

BOS = 1  # <|im_start|>, SmolLM2's bos_token
TEXT = "Special tokens lead a prompt"
MESSAGES = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("tiny-bos") / "model"
    shutil.copytree(tiny_model_dir, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, seq],
        "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS], "tokens": ["<|im_start|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def tok(bos_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(bos_model_dir)
    assert tokenizer.encode(TEXT)[0] == BOS != tokenizer.encode(TEXT, add_special_tokens=False)[0]
    return tokenizer


def chat_ids(tok) -> list[int]:
    return tok.encode(
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def test_offline_text_prompt_gets_the_bos(bos_model_dir, tok):
    llm = LLM(model=str(bos_model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    (out,) = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert out.prompt_token_ids == tok.encode(TEXT) and out.prompt_token_ids[0] == BOS


def test_server_adds_special_tokens_as_vllm_does(bos_model_dir, tok):
    plain = tok.encode(TEXT, add_special_tokens=False)
    with ServerThread(bos_model_dir, *TINY_ARGS) as server:

        def post(path: str, **body: object) -> dict:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        def completion_prompt(**body: object) -> list[int]:
            r = post("/v1/completions", prompt=TEXT, max_tokens=1, return_token_ids=True, **body)
            return r["choices"][0]["prompt_token_ids"]

        assert completion_prompt() == [BOS, *plain]
        assert completion_prompt(add_special_tokens=False) == plain
        scored = post("/v1/completions", prompt=TEXT, echo=True, logprobs=0, max_tokens=0)["choices"][0]
        assert scored["text"] == TEXT  # the prompt as sent; its logprobs start at the <bos>, unscored
        assert scored["logprobs"]["tokens"][0] == "<|im_start|>" and scored["logprobs"]["token_logprobs"][0] is None
        assert len(scored["logprobs"]["tokens"]) == len(plain) + 1
        assert post("/tokenize", prompt=TEXT)["tokens"] == [BOS, *plain]
        assert post("/tokenize", prompt=TEXT, add_special_tokens=False)["tokens"] == plain
        chat = post("/v1/chat/completions", messages=MESSAGES, max_tokens=1, return_token_ids=True)
        assert chat["prompt_token_ids"] == chat_ids(tok)  # the template's tokens, none added
        assert post("/tokenize", messages=MESSAGES)["tokens"] == chat_ids(tok)
        assert post("/tokenize", messages=MESSAGES, add_special_tokens=True)["tokens"] == [BOS, *chat_ids(tok)]
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": TEXT, "add_special_tokens": "yes"}, timeout=60)
        assert r.status_code == 400 and "add_special_tokens" in r.text


def test_router_tokenizes_as_the_replica(bos_model_dir, tok):
    local = Tokenization(tokenizer=RouterTokenizer.from_dir(bos_model_dir), local=True)

    def prompts(kind: str, **body: object) -> list[list[int]]:
        return asyncio.run(local.prompts(kind, body, None))

    assert prompts("completion", prompt=TEXT) == [tok.encode(TEXT)]
    assert prompts("completion", prompt=TEXT, add_special_tokens=False) == [tok.encode(TEXT, add_special_tokens=False)]
    assert prompts("completion", prompt=[5, 6]) == [[5, 6]]  # token ids go as they are
    assert prompts("chat", messages=MESSAGES) == [chat_ids(tok)]
    assert prompts("chat", messages=MESSAGES, add_special_tokens=True) == [[BOS, *chat_ids(tok)]]
    assert prompts("completion", prompt=TEXT, add_special_tokens="yes") == []  # the replica's 400

    sent = []

    async def replica_tokenize(authorization, payload):
        sent.append(payload)
        return [BOS]

    remote = Tokenization(remote=replica_tokenize)
    asyncio.run(remote.prompts("completion", {"prompt": TEXT}, None))
    asyncio.run(remote.prompts("chat", {"messages": MESSAGES}, None))
    assert [p["add_special_tokens"] for p in sent] == [True, False]
