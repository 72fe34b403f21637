"""Gemma 3 in the engine, on a tiny random checkpoint with a 16-token window (so short
prompts cross it many times): logits against transformers, and greedy outputs that do not
depend on chunking, prefix caching (radix and hash), preemption, n > 1 or beam search, or
on whether window blocks are released (the hybrid KV cache) or every layer keeps them all;
prefixes shared in flight and loaded from the tiers (a restart too) in every KV group.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.sampling_params import BeamSearchParams

WINDOW = 16
TINY_GEMMA3 = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,  # five window layers, then a global one
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=32,  # not head_dim: the scale is checked too
    sliding_window=WINDOW,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Random weights (norms too: Gemma's are (1 + w), so zeros would hide a missing 1), and
    the LM head scaled so greedy choices are far apart (as `sharp_tiny_dir` does)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma3_text", **TINY_GEMMA3)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    weights = load_file(path / "model.safetensors")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_logits(engine: LLMEngine, tokens: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits through the engine's KV groups, prefilled in chunks."""
    req = Request("logits", tokens, SamplingParams())
    out = []
    with torch.inference_mode():
        while req.num_computed_tokens < len(tokens):
            n = min(chunk, len(tokens) - req.num_computed_tokens)
            assert engine.kv.allocate_slots(req, n)
            ids, pos, meta, _ = engine.runner._prepare([ScheduledRequest(req, n)])
            hidden = engine.runner.model(ids, pos, engine.runner.kv_caches, meta)
            out.append(engine.runner.model.compute_logits(hidden))
            req.num_computed_tokens += n
            engine.kv.cache_full_blocks(req)
    engine.kv.free(req)
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [200, 13, 1])  # whole (SDPA), short chunks and decodes (the paged kernel)
def test_tiny_logits_match_transformers(tiny_gemma3_dir, chunk):
    ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    tokens = prompt(200, seed=1)
    with torch.inference_mode():
        expected = ref(torch.tensor([tokens])).logits[0].float()
    engine = LLMEngine(EngineConfig(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=128))
    assert engine.kv_config.num_groups == 6  # one full group, five window groups of one layer each
    got = engine_logits(engine, tokens, chunk)
    assert (got - expected).abs().max().item() < 1e-3


CONFIGS = {
    "hybrid": {},
    "chunked": {"max_num_batched_tokens": 24},
    "radix": {"prefix_cache": "radix"},
    "hash": {"prefix_cache": "hash"},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "preempted": {"num_kv_blocks": 40, "max_num_batched_tokens": 64},
}
PROMPTS = [prompt(70, seed=2), prompt(70, seed=2)[:50] + prompt(30, seed=3), prompt(9, seed=4), prompt(120, seed=5)]


def greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(max_tokens=40, temperature=0.0, n=n, ignore_eos=True)
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference_outputs(tiny_gemma3_dir):
    """Every layer keeps its whole history (no hybrid KV cache), nothing cached, one at a time."""
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", disable_hybrid_kv_cache_manager=True)
    assert llm.llm_engine.kv_config.num_groups == 1
    return [greedy(llm, [p])[0] for p in PROMPTS]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_outputs_do_not_depend_on_how_the_kv_is_kept(tiny_gemma3_dir, reference_outputs, name):
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", **{"num_kv_blocks": 512, **CONFIGS[name]})
    engine = llm.llm_engine
    assert greedy(llm, PROMPTS) == reference_outputs  # batched, and across the window many times
    if name in ("radix", "hash"):  # again: now the prompts' blocks are cached
        before = engine.kv.prefix_stats.hits
        assert greedy(llm, PROMPTS) == reference_outputs
        assert engine.kv.prefix_stats.hits > before
    if name == "preempted":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used_blocks == 0


def test_n_samples_and_beams_share_window_blocks(tiny_gemma3_dir, reference_outputs):
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=512)
    samples = greedy(llm, PROMPTS[:2], n=3)  # siblings fork every group's table
    assert samples == [ref * 3 for ref in reference_outputs[:2]]
    full = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=512, disable_hybrid_kv_cache_manager=True)
    params = BeamSearchParams(beam_width=3, max_tokens=24)
    hybrid_beams = llm.beam_search([PROMPTS[0]], params)
    full_beams = full.beam_search([PROMPTS[0]], params)
    # the same beams; scores to 1e-4 (a prefix hit computes the prompt's K/V apart from its query)
    assert [s.tokens for s in hybrid_beams[0].sequences] == [s.tokens for s in full_beams[0].sequences]
    expected = [s.cum_logprob for s in full_beams[0].sequences]
    assert [s.cum_logprob for s in hybrid_beams[0].sequences] == pytest.approx(expected, abs=1e-4)


def test_requests_sent_together_share_a_prefix_in_flight_in_every_group(tiny_gemma3_dir, reference_outputs):
    """PROMPTS[1] shares PROMPTS[0]'s first 50 tokens: admitted in the same step, it reads their
    3 blocks (in every group, the window's) as the other request computes them."""
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=512)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [r[0] for r in reference_outputs[:2]]
    assert [o.num_cached_tokens for o in outs] == [0, 48]


def test_a_prompt_chunk_too_large_for_the_whole_pool_is_split_to_fit(tiny_gemma3_dir, reference_outputs):
    """120 tokens in one chunk take 8 blocks in each of the 6 groups, 48 of a 40-block pool,
    though the request holds at most 10 + 5 x 2 at a time: it is prefilled in two chunks."""
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=40)
    assert greedy(llm, [PROMPTS[3]]) == [reference_outputs[3]]
    assert llm.llm_engine.kv.pool.num_used_blocks == 0


def _tier(tier: str, tmp_path: Path) -> dict:
    if tier == "host":
        return {"kv_host_memory": "64MiB"}
    return {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB"}


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_window_groups_come_back_from_a_tier_with_only_their_window(tiny_gemma3_dir, reference_outputs, tmp_path, tier):
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=40, **_tier(tier, tmp_path))
    store = llm.llm_engine.store
    # a stored block holds each KV tensor once, not once per layer sharing it
    assert (
        store.namespace.block_shape[0]
        == llm.llm_engine.kv_config.num_slots
        < llm.llm_engine.model_config.num_hidden_layers
    )
    assert greedy(llm, [PROMPTS[3]]) == [reference_outputs[3]]
    greedy(llm, [prompt(120, seed=100 + i) for i in range(3)])  # the small pool evicts every block of the first
    store.flush()
    before = store.use[tier].served
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[3]], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference_outputs[3][0]
    assert out.num_cached_tokens == 112  # 7 whole blocks of the 120-token prompt
    # the full group's 7 blocks, and of each of the 5 window groups only the one a query at 112 still sees
    assert store.use[tier].served - before == 7 + 5


def test_a_restarted_engine_serves_a_gemma_chat_turn_from_disk(tiny_gemma3_dir, tmp_path):
    kv = _tier("disk", tmp_path)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=512, **kv)
    (turn1,) = first.generate([PROMPTS[3]], params, use_tqdm=False)
    first.llm_engine.shutdown()  # write-back: what the pool still caches goes to disk now
    turn2 = PROMPTS[3] + list(turn1.outputs[0].token_ids) + prompt(20, seed=9)

    restarted = LLM(model=str(tiny_gemma3_dir), dtype="float32", num_kv_blocks=512, **kv)
    (out,) = restarted.generate([turn2], params, use_tqdm=False)
    cold = LLM(model=str(tiny_gemma3_dir), dtype="float32", enable_prefix_caching=False)
    (expected,) = cold.generate([turn2], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.num_cached_tokens == 144  # the 160-token history but its last token (never computed)
    assert restarted.llm_engine.store.use["disk"].served == 9 + 5


def test_window_bench_releases_window_blocks(tiny_gemma3_dir):
    """`kvserve bench window` on the tiny model: 200-token prompts hold far fewer blocks with
    the window groups released, more of them decode together, and the outputs are the same."""
    from kvserve.bench.window import run_window_bench

    # 480 KiB: 120 one-layer blocks with the window groups, 20 six-layer blocks without; short
    # chunks, since during a chunk's step the window groups hold blocks for all of its tokens
    config = EngineConfig(
        model=str(tiny_gemma3_dir),
        dtype="float32",
        kv_cache_memory="480KiB",
        max_num_seqs=16,
        max_num_batched_tokens=48,
    )
    r = run_window_bench(config, context_len=200, output_len=24, num_prompts=4, seed=0, log=lambda *_: None)
    # 223 tokens at most between steps: 14 blocks of the full group + 2 in each of 5 window groups
    assert (r.hybrid.peak_blocks_per_request, r.full.peak_blocks_per_request) == (14 + 5 * 2, 14)
    assert (r.hybrid.pool_blocks, r.full.pool_blocks) == (120, 20)
    assert r.kv_memory_saved > 0.7 and r.hybrid.capacity >= 3 * r.full.capacity
    assert r.hybrid.peak_decoding > r.full.peak_decoding == 1
    assert r.same_outputs and r.matching_outputs == 4
