"""Beam search in the engine: against transformers' `generate(num_beams=...)`, alone against
batched, with every prefix cache and under preemption, and the KV blocks beams share.

The fast tests use the tiny random Llama with its LM head scaled up (`sharp_tiny_dir`): the
plain one's next-token distribution is nearly uniform, so candidates 1e-6 apart would swap
on a different batch shape's rounding. The SmolLM2 test (slow) is the real model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.config import DEFAULT_MODEL
from kvserve.engine.beam_group import BeamGroup
from kvserve.models.loader import short_name_path
from kvserve.outputs import BeamSearchOutput
from kvserve.sampling_params import BeamSearchParams

SCORE_TOL = 1e-4  # fp32: |our score - transformers' score|


@pytest.fixture(scope="module")
def sharp_tiny_dir(tiny_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharp-tiny")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 30.0  # top candidates ~0.1-1 nats apart, far above rounding
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def sharp_pair(sharp_tiny_dir):
    ref = AutoModelForCausalLM.from_pretrained(sharp_tiny_dir, dtype=torch.float32).eval()
    return ref, LLM(model=str(sharp_tiny_dir), dtype="float32", kv_cache_memory="32MiB")


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_beams(model, prompt: list[int], width: int, max_new: int, lp: float, es, eos: list[int]):
    """transformers' best `width` beams: (generated tokens, score) each, best first."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=lp,
            early_stopping=es,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    tokens = [row[len(prompt) : len(prompt) + n] for row, n in zip(out.sequences.tolist(), lengths, strict=True)]
    return tokens, out.sequences_scores.tolist()


def assert_same_beams(ours: BeamSearchOutput, tokens: list[list[int]], scores: list[float]) -> None:
    n = len(ours.prompt_token_ids)
    assert [s.tokens[n:] for s in ours.sequences] == tokens
    assert max(abs(s.score - ref) for s, ref in zip(ours.sequences, scores, strict=True)) <= SCORE_TOL


def frequent_token(model, prompt: list[int], rank: int = 0) -> int:
    """A token the model likes after this prompt: as an extra EOS id it ends beams often."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return logprobs.mean(0).argsort(descending=True)[rank].item()


@pytest.mark.parametrize(
    "width,es,lp,prompt_len,extra_eos",
    [(2, True, 0.0, 10, True), (4, False, 1.0, 200, False), (8, "never", 2.0, 10, True), (4, True, 2.0, 200, True)],
)
def test_tiny_matches_transformers(sharp_pair, width, es, lp, prompt_len, extra_eos):
    ref, llm = sharp_pair
    prompt = random_prompt(prompt_len, seed=width)
    stop = [frequent_token(ref, prompt)] if extra_eos else []
    tokens, scores = hf_beams(ref, prompt, width, 16, lp, es, [2, *stop])
    params = BeamSearchParams(width, 16, length_penalty=lp, early_stopping=es, stop_token_ids=tuple(stop))
    assert_same_beams(llm.beam_search(prompt, params)[0], tokens, scores)


BATCH_PARAMS = [
    BeamSearchParams(4, 16),
    BeamSearchParams(8, 12, length_penalty=0.0, early_stopping=True),
    BeamSearchParams(2, 20, early_stopping="never", length_penalty=2.0),
]
OTHERS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), SamplingParams(n=3, seed=1, max_tokens=12)]


def beam_results(out) -> list[tuple[list[int], float]]:
    return [(c.token_ids, c.score) for c in out.outputs]


def assert_close(got: list[tuple[list[int], float]], want: list[tuple[list[int], float]]) -> None:
    """Same tokens; scores within rounding (a different batch shape, or chunking, rounds differently)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= SCORE_TOL


@pytest.fixture(scope="module")
def alone(sharp_tiny_dir):
    """Each beam request alone, prefix caching off."""
    llm = LLM(model=str(sharp_tiny_dir), dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    prompts = [random_prompt(n, seed=n) for n in (10, 37, 200)]
    outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, BATCH_PARAMS, strict=True)]
    return prompts, [beam_results(out) for out in outs]


@pytest.mark.parametrize(
    "config",
    [
        dict(enable_prefix_caching=False),
        dict(prefix_cache="radix"),
        dict(prefix_cache="hash"),
        dict(max_num_batched_tokens=12),  # beams of a group split over steps, prompts chunked
        dict(num_kv_blocks=48, enable_prefix_caching=False),  # preemption, beam groups resumed
    ],
    ids=["no-prefix-cache", "radix", "hash", "small-budget", "preemption"],
)
def test_batched_equals_alone(sharp_tiny_dir, alone, config, monkeypatch):
    resumed = []
    preempt = BeamGroup.preempt
    monkeypatch.setattr(BeamGroup, "preempt", lambda self: resumed.append(len(self.beams)) or preempt(self))
    prompts, want = alone
    llm = LLM(model=str(sharp_tiny_dir), dtype="float32", kv_cache_memory="32MiB", **config)
    # twice each prompt (the second time a cache hit), with greedy and sampled requests between
    batch = [p for p in prompts for _ in range(2)] + prompts[:2]
    params = [sp for sp in BATCH_PARAMS for _ in range(2)] + OTHERS
    outs = llm.generate(batch, params, use_tqdm=False)
    for i, out in enumerate(outs[:6]):
        assert_close(beam_results(out), want[i // 2])
    assert llm.llm_engine.kv.pool.num_used_blocks == 0
    if "num_kv_blocks" in config:
        assert llm.llm_engine.stats.num_preemptions > 0 and max(resumed) > 1


def test_block_accounting_every_step(sharp_tiny_dir):
    """After every step the blocks in use are exactly the union of the live beams' tables, far
    fewer than the beams' tables hold together; at the end none is in use."""
    llm = LLM(model=str(sharp_tiny_dir), dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    engine = llm.llm_engine
    for i, width in enumerate([4, 8]):
        engine.add_request(random_prompt(200, seed=i), BeamSearchParams(width, 20, ignore_eos=True))
    peak_union, peak_separate = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        kv = engine.kv
        beams = [r for r in engine.scheduler.running if r.beam is not None]
        union = {b for r in beams for b in kv.block_ids(r)}
        used = {b.block_id for b in kv.pool.blocks if b.ref_cnt > 0}
        assert used == union
        groups = {id(r.beam): r.beam for r in beams}.values()
        assert sum(len(g.block_ids(kv)) for g in groups) == len(used)  # each block held by one group
        kv.check_integrity()  # every block's ref count = the tables holding it
        peak_union = max(peak_union, len(union))
        peak_separate = max(peak_separate, sum(len(kv.block_ids(r)) for r in beams))
    assert engine.kv.pool.num_used_blocks == 0
    assert peak_union < peak_separate / 2  # 12 shared prompt blocks, 2 of each beam's own


def test_beam_search_outputs(sharp_tiny_dir):
    llm = LLM(model=str(sharp_tiny_dir), dtype="float32", kv_cache_memory="32MiB")
    tok = llm.get_tokenizer()
    text = "the quick brown fox jumps over"
    free = llm.beam_search([text], BeamSearchParams(3, 12, length_penalty=0.5))[0]
    assert free.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len(free.sequences) == 3
    for s in free.sequences:
        generated = s.tokens[len(free.prompt_token_ids) :]
        assert s.text == tok.decode(generated, skip_special_tokens=True)
        assert s.score == pytest.approx(s.cum_logprob / len(generated) ** 0.5, abs=1e-5)
        assert s.finish_reason == "length" and s.stop_reason is None
    assert [s.score for s in free.sequences] == sorted((s.score for s in free.sequences), reverse=True)
    # a token of the best beam as a stop token: beams that reach it end there
    stop = free.sequences[0].tokens[len(free.prompt_token_ids) + 3]
    params = BeamSearchParams(3, 12, length_penalty=0.5, stop_token_ids=[stop], num_return_sequences=2)
    ids = free.prompt_token_ids
    out = llm.beam_search([ids, ids], params)
    assert out[0] == out[1] and len(out[0].sequences) == 2
    ended = [s for s in out[0].sequences if s.finish_reason == "stop"]
    assert ended and all(s.tokens[-1] == stop and s.stop_reason == stop for s in ended)
    assert llm.llm_engine.kv.pool.num_used_blocks == 0


def test_abort_and_bad_beam_search_requests(sharp_tiny_dir):
    llm = LLM(model=str(sharp_tiny_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8, block_size=16)
    engine = llm.llm_engine
    rid = engine.add_request(random_prompt(40, seed=0), BeamSearchParams(8, 50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.running) == 8
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="beam_width=9 is larger than max_num_seqs=8"):
        llm.beam_search([[5, 6, 7]], BeamSearchParams(9, 4))
    with pytest.raises(ValueError, match="may need 75 KV blocks, more than the pool's 64"):
        llm.beam_search([random_prompt(300, seed=0)], BeamSearchParams(8, 100))
    with pytest.raises(TypeError, match="must be BeamSearchParams"):
        llm.beam_search([[5, 6]], SamplingParams())
    for bad, match in [
        (dict(early_stopping="sometimes"), "early_stopping must be"),
        (dict(num_return_sequences=5), r"num_return_sequences must be in \[1, 4\]"),
        (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
        (dict(length_penalty=-3.3e16), r"length_penalty must be in \[-50, 50\]"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(4, 8, **bad)
    assert not engine.has_unfinished_requests()


# SmolLM2 against transformers reading the same GGUF: every value of beam width, early_stopping
# and length_penalty (each pair of them once: a Latin square), prompts of 10 and 200 tokens,
# beams ended by EOS (a frequent token, ",", as an extra EOS id) and by max_tokens.
# transformers' beams are recorded in REFERENCE (`python tests/test_beam_search_engine.py`
# writes it: about 5 minutes on 2 cores); with another transformers version, or other
# prompts, the test computes them itself.
SMOLLM2_CASES = [
    (w, es, [0.0, 1.0, 2.0][(i + j) % 3], [10, 200][(i + j) % 2], (i + 2 * j) % 3 != 2)
    for i, w in enumerate([2, 4, 8])
    for j, es in enumerate([False, True, "never"])
]
SMOLLM2_MAX_TOKENS = 12
SMOLLM2_TEXT = (
    "The history of the city goes back to Roman times, when a small fort stood by the river. "
    "Over the centuries it grew into a market town, then an industrial centre, and today it is "
)
REFERENCE = Path(__file__).parent / "data" / "smollm2_beam_search_transformers.json"


def smollm2_case(tok, eos: list[int], width, es, lp, prompt_len, extra_eos) -> dict:
    prompt = (tok.encode(SMOLLM2_TEXT * 8, add_special_tokens=False) * 2)[-prompt_len:]
    stop = [tok.encode(",", add_special_tokens=False)[0]] if extra_eos else []
    return dict(key=f"{width}-{es}-{lp}-{prompt_len}-{extra_eos}", prompt=prompt, eos=eos + stop, stop=stop)


def record_smollm2_reference(model_dir: Path) -> dict:
    """transformers' beams for every case, loading the GGUF into transformers once."""
    from kvserve.models.loader import load_config
    from kvserve.tokenizer import load_tokenizer

    tok, eos = load_tokenizer(model_dir), list(load_config(model_dir).eos_token_ids)
    gguf = short_name_path(DEFAULT_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    cases = {}
    for width, es, lp, n, extra in SMOLLM2_CASES:
        case = smollm2_case(tok, eos, width, es, lp, n, extra)
        case["tokens"], case["scores"] = hf_beams(ref, case["prompt"], width, SMOLLM2_MAX_TOKENS, lp, es, case["eos"])
        cases[case.pop("key")] = case
    return {"transformers": transformers.__version__, "gguf": gguf.name, "cases": cases}


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir) -> dict:
    recorded = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    if recorded.get("transformers") == transformers.__version__ and len(recorded["cases"]) == len(SMOLLM2_CASES):
        return recorded["cases"]
    return record_smollm2_reference(smollm2_dir)["cases"]


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir) -> LLM:
    return LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory="256MiB")


@pytest.mark.slow
@pytest.mark.parametrize("width,es,lp,prompt_len,extra_eos", SMOLLM2_CASES)
def test_smollm2_matches_transformers(smollm2_llm, smollm2_reference, width, es, lp, prompt_len, extra_eos):
    eos = list(smollm2_llm.llm_engine.eos_token_ids)
    case = smollm2_case(smollm2_llm.get_tokenizer(), eos, width, es, lp, prompt_len, extra_eos)
    ref = smollm2_reference[case["key"]]
    assert (ref["prompt"], ref["eos"]) == (case["prompt"], case["eos"]), "stale reference: re-record it"
    params = BeamSearchParams(
        width, SMOLLM2_MAX_TOKENS, length_penalty=lp, early_stopping=es, stop_token_ids=tuple(case["stop"])
    )
    assert_same_beams(smollm2_llm.beam_search(case["prompt"], params)[0], ref["tokens"], ref["scores"])


def test_smollm2_cases_end_beams_both_ways():
    """The recording has beams ended by EOS and beams ended by max_tokens."""
    cases = json.loads(REFERENCE.read_text())["cases"].values()
    lengths = [len(t) for c in cases for t in c["tokens"]]
    assert min(lengths) < SMOLLM2_MAX_TOKENS and SMOLLM2_MAX_TOKENS in lengths
    assert {len(c["prompt"]) for c in cases} == {10, 200}


if __name__ == "__main__":  # record transformers' beams for the SmolLM2 test
    from kvserve.models.loader import resolve_model

    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(record_smollm2_reference(resolve_model(DEFAULT_MODEL)), indent=1) + "\n")
    print(f"wrote {REFERENCE}")
