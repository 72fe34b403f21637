"""The offline API on a tiny random model: shapes of outputs, stops, n > 1, bad input."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)


def assert_idle(llm: LLM) -> None:
    kv = llm.llm_engine.kv
    kv.pool.check_integrity()
    assert kv.pool.num_used_blocks == 0 and not kv.block_tables


def test_outputs_in_input_order_with_text_and_token_prompts(llm):
    tok = llm.get_tokenizer()
    prompts = ["hello world", tok.encode("a much longer prompt " * 5), "x"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello world", None, "x"]
    assert outs[1].prompt_token_ids == prompts[1]
    for o in outs:
        (c,) = o.outputs
        assert len(c.token_ids) == 8 and c.finish_reason == "length" and o.finished
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_idle(llm)


def test_stop_string_is_cut_from_text(llm):
    free = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[3:6]  # a piece of what greedy will produce
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    out = llm.generate("hello", sp, use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == free.text[: free.text.index(stop)]
    assert_idle(llm)


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[2]
    sp = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    c = llm.generate("hello", sp, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    late = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[stop_id])
    c = llm.generate("hello", late, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 8 and c.finish_reason == "length"


def test_logprobs_top_k_per_token(llm):
    c = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and all(lp.decoded_token is not None for lp in entry.values())
    chosen = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    assert c.cumulative_logprob == pytest.approx(sum(chosen))


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("tell me", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)] * 3
    batch = llm.generate(["a", "tell me", "b c d", "e"], [others[0], sp, *others[1:]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_with_copy_on_write(llm):
    """n=8 on a 200-token prompt: 13 blocks allocated once, the partial one copied 7 times."""
    engine = llm.llm_engine
    pool, kv = engine.kv.pool, engine.kv
    allocated, copies = pool.num_allocations, kv.num_cow_copies
    prompt = list(range(1000, 1200))
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
    engine.add_request(prompt, sp, request_id="fork")
    engine.step()  # prefill once; the 8 samples fork from it
    assert pool.num_allocations - allocated == 13  # ceil(200 / 16), shared by all 8
    assert len({tuple(kv.block_ids(r)) for r in engine.scheduler.running}) == 1
    assert kv.num_cow_copies == copies
    engine.step()  # each writes its first token into the shared partial block
    assert kv.num_cow_copies - copies == 7  # the last writer owns it alone by then
    assert pool.num_allocations - allocated == 13 + 7
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (final,) = [o for o in outs if o.finished]
    assert [c.index for c in final.outputs] == list(range(8))
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # samples differ
    assert_idle(llm)


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        (list(range(600)), {}, "max_model_len"),
        ("", {}, "empty"),
        ([5, -1], {}, "token ids"),
        ([5, 10**9], {}, "token ids"),
        ("hi", {"n": 1000}, "max_num_seqs"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(llm, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], SamplingParams(**kwargs), use_tqdm=False)
    assert_idle(llm)
    assert llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_larger_than_the_pool_is_rejected(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV cache"):
        small.generate(list(range(100)), GREEDY, use_tqdm=False)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("a long story " * 20, SamplingParams(max_tokens=100, n=2), request_id="gone")
    engine.step()
    assert engine.kv.pool.num_used_blocks > 0
    engine.abort_request("gone")
    assert_idle(llm)
    assert not engine.has_unfinished_requests()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\nhi<|im_end|>" in out.prompt and out.prompt.endswith("assistant\n")


def test_engine_stats_count_what_ran(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB")
    outs = llm.generate([[1] * 20, [2] * 40], GREEDY, use_tqdm=False)
    s = llm.llm_engine.stats
    assert s.prompt_tokens == 60 and s.prefill_tokens_computed == 60
    assert s.generation_tokens == 16 and s.finished_requests == {"length": 2}
    assert s.peak_kv_blocks_used == 2 + 3 and s.last_step.kv_blocks_used == 0
    for o in outs:
        m = o.metrics
        assert 0 <= m.queue_time <= m.time_to_first_token and m.decode_time >= 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_from_the_fused_lm_head_match_the_logits_path(tiny_model_dir, monkeypatch, dtype):
    """On a CPU with the small-batch kernel (bf16, or fp32 on its AVX2 path) greedy steps take the head's own argmax."""
    llm = LLM(
        model=str(tiny_model_dir), dtype=str(dtype).removeprefix("torch."), kv_cache_memory="32MiB", max_model_len=512
    )
    model = llm.llm_engine.runner.model
    if model.greedy_tokens(torch.zeros(1, model.config.hidden_size, dtype=dtype)) is None:
        pytest.skip("no fused LM head on this machine")
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60)), [7] * 20]
    fused_calls = []
    greedy_tokens = model.greedy_tokens
    # min_tokens: the head skips EOS (banned ids) until the 8th token, as the sampler masks it
    for params in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=8),
    ):
        monkeypatch.setattr(model, "greedy_tokens", lambda h, b: fused_calls.append(len(h)) or greedy_tokens(h, b))
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        monkeypatch.setattr(model, "greedy_tokens", lambda h, b: None)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == fused
    assert sum(fused_calls) >= 3 * 12 + 3 * 8


def test_invariants_are_checked_whenever_the_engine_goes_idle(llm, monkeypatch):
    """KVSERVE_CHECK_INVARIANTS=1 (set by conftest): a leaked block fails the next idle check."""
    engine = llm.llm_engine
    assert engine.check_invariants
    checks = []
    real_check = engine.kv.check_integrity
    monkeypatch.setattr(engine.kv, "check_integrity", lambda: checks.append(1) or real_check())
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert len(checks) == 1  # once: the step after which nothing was left to run
    (leaked,) = engine.kv.pool.get_new_blocks(1)
    try:
        with pytest.raises(AssertionError, match="ref counts"):
            llm.generate(["hello"], GREEDY, use_tqdm=False)
    finally:
        engine.kv.pool.free_blocks([leaked])
    assert_idle(llm)


def test_an_unsupported_architecture_is_named_in_the_error():
    from kvserve.models.config import ModelConfig
    from kvserve.models.registry import model_class

    cfg = dict(model_type="mamba", vocab_size=8, hidden_size=8, intermediate_size=8)
    with pytest.raises(ValueError, match="'mamba' is not supported yet .supported: llama, mistral"):
        ModelConfig.from_hf_config(cfg | dict(num_hidden_layers=1, num_attention_heads=1))
    with pytest.raises(ValueError, match="'mamba' is not supported yet"):
        model_class("mamba")
    assert model_class("qwen2").__name__ == "LlamaForCausalLM"
