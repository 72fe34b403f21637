"""A request's greedy output does not depend on its batch, on chunking or on preemption.

SmolLM2 in float32: the real model, whose top-2 logit gaps are far above the
~1e-5 noise that a different batch shape adds to a matmul.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a robot", "bread", "mountains", "a library", "winter", "a violin", "trains"]


def mixed_prompts(llm: LLM) -> list[list[int]]:
    """16 prompts from 5 to ~200 tokens."""
    tok = llm.get_tokenizer()
    prompts = []
    for i in range(16):
        text = f"Write about {TOPICS[i % 8]}. " + "Some context here. " * (i * i // 2)
        prompts.append(tok.encode(text)[: 5 + 13 * i])
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """Each prompt alone in a roomy engine."""
    llm = LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory="512MiB")
    prompts = mixed_prompts(llm)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return llm, prompts, alone


def outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_batch_of_16_equals_alone(reference):
    llm, prompts, alone = reference
    assert outputs(llm, prompts) == alone
    assert llm.llm_engine.kv.pool.num_used_blocks == 0


def test_preemption_and_recompute_keep_outputs(reference, smollm2_dir):
    _, prompts, alone = reference
    # 40 blocks of 16 = 640 slots for 16 requests needing ~1,900: preemption is forced
    llm = LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=40)
    assert outputs(llm, prompts) == alone
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_used_blocks == 0


def test_chunked_prefill_equals_one_shot(reference, smollm2_dir):
    _, prompts, alone = reference
    # a 32-token budget splits every long prompt into chunks, mixed with decodes
    llm = LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory="512MiB", max_num_batched_tokens=32)
    assert outputs(llm, prompts) == alone
    assert llm.llm_engine.stats.num_steps > len(prompts[-1]) // 32


def test_prefill_first_keeps_outputs(reference, smollm2_dir):
    _, prompts, alone = reference
    # 4 seats for 16 requests: new prompts keep arriving while others decode, and each
    # takes a step of its own
    llm = LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory="512MiB", max_num_seqs=4, prefill_first=True)
    assert outputs(llm, prompts) == alone
    assert llm.llm_engine.kv.pool.num_used_blocks == 0
