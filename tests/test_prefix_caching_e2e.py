"""Prefix caching end to end on SmolLM2 (float32): same outputs, the expected hits, no cross-tenant hits.

num_cached_tokens formula: a request whose prompt shares `c` leading tokens with
what is cached (earlier prompts and their generated tokens) gets
min(c // block_size, (prompt_len - 1) // block_size) * block_size; the last
prompt token is always computed, and only whole blocks are reused.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SYSTEM = "You are a meticulous assistant. " + "Answer briefly and cite the rule you used. " * 12
QUESTIONS = [f"Question {i}: what is {i} times {i + 3}?" for i in range(16)]
TURNS = ["Tell me about owls.", "Where do they live?", "What do they eat?"]


def make(smollm2_dir, **kwargs) -> LLM:
    return LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory="256MiB", **kwargs)


@pytest.fixture(scope="module")
def engines(smollm2_dir) -> dict[str, LLM]:
    return {
        "off": make(smollm2_dir, enable_prefix_caching=False),
        "radix": make(smollm2_dir, prefix_cache="radix"),
        "hash": make(smollm2_dir, prefix_cache="hash"),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(prompt: list[int], cached_tokens: list[int]) -> int:
    return min(common_prefix(prompt, cached_tokens) // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK


def run_shared_prefix(llm: LLM):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(SYSTEM + q) for q in QUESTIONS]
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)  # fills the cache
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    return prompts, first + rest


def run_multiturn(llm: LLM):
    messages, outs = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def shared_prefix_runs(engines):
    return {name: run_shared_prefix(llm) for name, llm in engines.items()}


def test_shared_system_prompt_same_outputs_and_expected_hits(shared_prefix_runs, engines):
    tokens = {name: [o.outputs[0].token_ids for o in outs] for name, (_, outs) in shared_prefix_runs.items()}
    assert tokens["radix"] == tokens["off"] and tokens["hash"] == tokens["off"]
    prompts, outs = shared_prefix_runs["radix"]
    filled = prompts[0] + outs[0].outputs[0].token_ids
    for name in ("radix", "hash"):
        cached = [o.num_cached_tokens for o in shared_prefix_runs[name][1]]
        assert cached[0] == 0
        assert cached[1:] == [expected_cached(p, filled) for p in prompts[1:]]
        system_blocks = len(engines[name].get_tokenizer().encode(SYSTEM)) // BLOCK
        assert all(c >= (system_blocks - 1) * BLOCK for c in cached[1:])  # the system prompt, give or take a block
    assert all(o.num_cached_tokens == 0 for o in shared_prefix_runs["off"][1])
    stats = engines["radix"].llm_engine.stats
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for o in shared_prefix_runs["radix"][1])


def test_multiturn_reuses_history(engines):
    runs = {name: run_multiturn(llm) for name, llm in engines.items()}
    texts = {name: [o.outputs[0].token_ids for o in outs] for name, outs in runs.items()}
    assert texts["radix"] == texts["off"] and texts["hash"] == texts["off"]
    for name in ("radix", "hash"):
        outs = runs[name]
        for prev, cur in zip(outs, outs[1:], strict=False):
            history = prev.prompt_token_ids + prev.outputs[0].token_ids
            assert cur.num_cached_tokens == expected_cached(cur.prompt_token_ids, history), name
            assert cur.num_cached_tokens >= len(prev.prompt_token_ids) - BLOCK


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_other_tenant_gets_no_hit(smollm2_dir, kind):
    llm = make(smollm2_dir, prefix_cache=kind)
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().encode(SYSTEM + QUESTIONS[0])

    def run(salt: str) -> int:
        engine.add_request(prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        return done[0].num_cached_tokens

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0  # same tokens, other tenant: nothing to see
    assert run("tenant-a") == expected_cached(prompt, prompt)


def test_reset_prefix_cache_refuses_while_running(engines):
    engine = engines["radix"].llm_engine
    engine.add_request("some prompt", GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_requests_admitted_together_compute_a_shared_prefix_once(engines, kind):
    """12 requests sharing a 240-token prefix in one call: the first computes it, the other 11
    reuse its blocks in the same step (in flight), with the outputs of a run without caching."""
    tok = engines["off"].get_tokenizer()
    prefix = (tok.encode(SYSTEM) * 3)[:240]  # 15 whole blocks
    prompts = [prefix + tok.encode(f" {q}") for q in QUESTIONS[:12]]
    llm = engines[kind]
    assert llm.llm_engine.reset_prefix_cache()
    stats = llm.llm_engine.stats
    before = stats.prefill_tokens_computed
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert stats.prefill_tokens_computed - before == len(prompts[0]) + sum(len(p) - 240 for p in prompts[1:])
    assert [o.num_cached_tokens for o in outs] == [0] + [240] * 11
    reference = engines["off"].generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
