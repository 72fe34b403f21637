"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`, the API's `echo` with `logprobs`)
against transformers' log_softmax on the same tiny random-weight Llama, in float32."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams

TOL = 1e-4  # nats; fp32 logits of the tiny model agree to ~1e-5


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Row p: the log_softmax of position p's logits, which score token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_prompt_logprobs(entries, token_ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Each later token's entry: the actual token and the top k, logprobs within TOL, ranks up
    to the ties TOL allows (a random model's distribution is nearly flat)."""
    assert len(entries) == len(token_ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, actual = ref[p], token_ids[p + 1]
        chosen = entry[actual]
        assert abs(chosen.logprob - row[actual].item()) <= TOL
        assert int((row > row[actual] + TOL).sum()) + 1 <= chosen.rank <= int((row > row[actual] - TOL).sum()) + 1
        tops = sorted((lp for t, lp in entry.items() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in tops] == list(range(1, k + 1))
        assert len(entry) in (k, k + 1)
        want = row.topk(k).values if k else torch.zeros(0)
        assert torch.allclose(torch.tensor([lp.logprob for lp in tops]), want, atol=TOL, rtol=0)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) <= TOL and lp.decoded_token is not None


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers(tiny_model_dir, hf_tiny, k):
    # max_num_batched_tokens 64: the 150-token prompt is prefilled in three chunks
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    prompts = [random_prompt(150, 1), random_prompt(20, 2)]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    for ids, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False), strict=True):
        check_prompt_logprobs(out.prompt_logprobs, ids, hf_logprobs(hf_tiny, ids), k)


def test_prompt_logprobs_ignore_a_cached_prefix(tiny_model_dir, hf_tiny):
    """A prefix-cache hit would skip positions: the request computes its whole prompt instead."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    ids = random_prompt(70, 3)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # caches its blocks
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out.prompt_logprobs, ids, hf_logprobs(hf_tiny, ids), 1)
    again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_prompt_logprobs_with_n_samples_and_under_preemption(tiny_model_dir, hf_tiny):
    """n > 1 reports the prompt's logprobs once; a request preempted mid-prompt and recomputed
    scores each position once (8 blocks: the three prompts cannot all fit)."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=32)
    prompts = [random_prompt(40, 10 + i) for i in range(3)]
    sp = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 2
        check_prompt_logprobs(out.prompt_logprobs, ids, hf_logprobs(hf_tiny, ids), 2)


def test_prompt_logprobs_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from test_server_common import TINY_ARGS, ServerThread

    with ServerThread(tiny_model_dir, *TINY_ARGS, "--max-num-batched-tokens", "64") as s:
        yield s


def completion(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo_logprobs(lp: dict, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """The prompt's part of an echoed `logprobs` object, in OpenAI's legacy completions shape."""
    n = len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [0]
    for token in lp["tokens"][: n - 1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"][:n] == offsets
    got = torch.tensor(lp["token_logprobs"][1:n])
    want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    for p, top in enumerate(lp["top_logprobs"][1:n]):
        assert len(top) in (k, k + 1)  # the actual token and the top k (strings may collide)
        assert max(top.values()) == pytest.approx(ref[p].max().item(), abs=TOL)


def test_echo_logprobs_match_transformers(server, hf_tiny):
    """A prompt longer than a chunk, then generated tokens after it (their offsets continue)."""
    prompt = random_prompt(100, 4)
    body = completion(server, prompt=prompt, echo=True, logprobs=2, max_tokens=3)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3 == len(lp["text_offset"]) == len(lp["top_logprobs"])
    check_echo_logprobs(lp, prompt, hf_logprobs(hf_tiny, prompt), 2)
    assert lp["text_offset"][len(prompt)] == sum(len(t) for t in lp["tokens"][: len(prompt)])
    generated = completion(server, prompt=prompt, logprobs=2, max_tokens=3)["choices"][0]
    assert lp["tokens"][len(prompt) :] == generated["logprobs"]["tokens"]
    assert choice["text"].endswith(generated["text"]) and choice["text"] != generated["text"]


def test_echo_with_no_tokens_is_a_loglikelihood(server, hf_tiny):
    """What lm-evaluation-harness's local-completions sends: echo, logprobs, max_tokens 0."""
    prompt = random_prompt(30, 5)
    body = completion(server, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    (choice,) = body["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_echo_logprobs(choice["logprobs"], prompt, hf_logprobs(hf_tiny, prompt), 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert choice["text"] == text
    plain = completion(server, prompt=prompt, echo=True, max_tokens=0)["choices"][0]  # no logprobs asked
    assert plain["text"] == text and plain["logprobs"] is None


def test_streamed_echo_logprobs_are_the_whole_ones(server):
    prompt = random_prompt(40, 6)
    whole = completion(server, prompt=prompt, echo=True, logprobs=1, max_tokens=4)["choices"][0]["logprobs"]
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0, "stream": True},
        timeout=60,
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    joined = {key: [v for part in parts for v in part[key]] for key in whole}
    assert joined == whole
