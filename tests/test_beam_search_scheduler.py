"""Beam groups in the scheduler, driven by a fake model: each beam's logprobs are a fixed
function of its tokens, so the scheduler's result must equal `BeamSearch` run directly over
the same function, bit for bit, whatever the batch, the token budget, the prefix cache or the
preemptions. After every step the group's blocks are exactly the union of its beams' tables.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine.beam_group import BEAM_SAMPLING_PARAMS, BeamGroup
from kvserve.engine.beam_search import BeamSearch, row_candidates
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import SampledToken, Scheduler, SchedulerConfig
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, make_prefix_cache
from kvserve.sampling_params import BeamSearchParams, SamplingParams

VOCAB = 64
EOS = 2
MAX_MODEL_LEN = 512


def fake_logprobs(tokens: list[int]) -> torch.Tensor:
    """The 'model': logprobs of the next token, a function of the whole sequence."""
    seed = hash(tuple(tokens)) % 2**61
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[EOS] += 2.0  # EOS wins now and then
    return torch.log_softmax(logits, dim=-1)


def reference(prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    eos = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    search = BeamSearch(
        params.beam_width,
        min(params.max_tokens, MAX_MODEL_LEN - len(prompt)),
        eos,
        params.length_penalty,
        params.early_stopping,
        params.num_return_sequences,
    )
    while not search.done:
        rows = torch.stack([fake_logprobs(prompt + t) for t in search.running_tokens])
        search.step(*row_candidates(rows, search.beams_to_keep))
    return [(h.token_ids, h.score) for h in search.results()]


def make_scheduler(num_blocks=256, block_size=4, max_num_seqs=32, budget=64, prefix_cache=None, prefill_first=False):
    kv = KVCacheManager(num_blocks, block_size, make_prefix_cache(prefix_cache, block_size))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, MAX_MODEL_LEN, prefill_first), kv)


def beam_request(s: Scheduler, rid: str, prompt: list[int], params: BeamSearchParams) -> Request:
    req = Request(rid, prompt, BEAM_SAMPLING_PARAMS, eos_token_ids=(EOS,))
    req.beam = BeamGroup(req, params, req.eos_token_ids, s.max_total_tokens)
    s.add_request(req)
    return req


def check_blocks(s: Scheduler, groups: list[BeamGroup]) -> None:
    """Each group holds exactly the union of its live beams' tables; nobody else holds them;
    every block's ref count is the number of tables holding it."""
    s.kv.check_integrity()
    used = {b.block_id for b in s.kv.pool.blocks if b.ref_cnt > 0}
    held_by_others = {i for r in s.running if r.beam is None for i in s.kv.block_ids(r)}
    union = set().union(*(g.block_ids(s.kv) for g in groups if not g.finished)) if groups else set()
    assert used == union | held_by_others
    for g in groups:
        assert not g.finished or not g.block_ids(s.kv)


def fake_step(s: Scheduler) -> None:
    """One step: beams get their logprobs, everyone else token 7."""
    out = s.schedule()
    sampled = {}
    for x in out.scheduled:
        if x.samples:
            r = x.request
            if r.beam is None:
                sampled[r.seq_id] = SampledToken(7)
                continue
            values, tokens = row_candidates(fake_logprobs(r.all_token_ids)[None], r.beam.search.beams_to_keep)
            sampled[r.seq_id] = SampledToken(-1, beam_candidates=(values[0], tokens[0]))
    sampled |= {child.seq_id: SampledToken(7) for _, child in out.forks}
    s.update_from_output(out, sampled)


def run(s: Scheduler, groups: list[BeamGroup], max_steps: int = 5000) -> int:
    """Step the fake engine to idle, checking the blocks after every step; returns the number of steps."""
    steps = 0
    while s.has_unfinished_requests():
        assert steps < max_steps, "no progress"
        fake_step(s)
        check_blocks(s, groups)
        steps += 1
    assert s.kv.pool.num_used_blocks == 0 and s.kv.block_tables == {}
    return steps


def results(group: BeamGroup) -> list[tuple[list[int], float]]:
    return [(h.token_ids, h.score) for h in group.results()]


PARAMS = [
    BeamSearchParams(4, 12),
    BeamSearchParams(2, 20, length_penalty=0.0, early_stopping=True),
    BeamSearchParams(8, 9, length_penalty=2.0, early_stopping="never", stop_token_ids=(5,)),
    BeamSearchParams(3, 15, ignore_eos=True, num_return_sequences=2),
]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 5, 13, 40]))] for _ in range(n)]


@pytest.mark.parametrize("params", PARAMS, ids=["w4", "w2-es", "w8-never-stop", "w3-ignore-eos"])
def test_one_group_equals_direct_search(params):
    s = make_scheduler()
    prompt = prompts(1, seed=params.beam_width)[0]
    req = beam_request(s, "a", prompt, params)
    run(s, [req.beam])
    assert results(req.beam) == reference(prompt, params)
    assert req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(prefix_cache="radix"),
        dict(prefix_cache="hash"),
        dict(budget=5),  # a group's beams split over steps, prompts chunked
        dict(prefill_first=True, budget=16),
        dict(num_blocks=60),  # preemption, of groups and of the others
        dict(num_blocks=40, prefix_cache="radix"),
        dict(num_blocks=40, prefix_cache="hash", budget=16),
        dict(max_num_seqs=9),  # groups wait for seats
    ],
)
def test_groups_in_a_batch_equal_direct_search(config):
    s = make_scheduler(**config)
    groups, refs, others = [], [], []
    for i, prompt in enumerate(prompts(6, seed=1)):
        params = PARAMS[i % len(PARAMS)]
        groups.append(beam_request(s, f"beam{i}", prompt, params).beam)
        refs.append(reference(prompt, params))
        other = Request(f"other{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True), eos_token_ids=(EOS,))
        s.add_request(other)
        others.append(other)
    run(s, groups)
    assert [results(g) for g in groups] == refs
    assert all(o.num_output_tokens == 8 for o in others)
    if config.get("num_blocks"):
        assert s.num_preemptions > 0


def test_a_preempted_group_resumes_from_its_shared_history(monkeypatch):
    """Preempted after it forked: the leader recomputes the history the beams share, the others
    fork from it and compute only their own tokens."""
    resumed = []
    preempt = BeamGroup.preempt

    def spy(self):
        leader = preempt(self)
        resumed.append((len(self.beams), self.resume_len, len(leader.all_token_ids)))
        return leader

    monkeypatch.setattr(BeamGroup, "preempt", spy)
    s = make_scheduler(num_blocks=30, block_size=4)
    hog = Request("hog", list(range(3, 53)), SamplingParams(max_tokens=60, ignore_eos=True), eos_token_ids=(EOS,))
    s.add_request(hog)  # older than the group: the group is the one preempted
    params = BeamSearchParams(4, 20, ignore_eos=True)
    prompt = list(range(10, 30))
    group = beam_request(s, "beams", prompt, params).beam
    run(s, [group])
    assert results(group) == reference(prompt, params)
    (num_beams, resume_len, leader_len), *_ = resumed
    assert num_beams == 4 and len(prompt) < resume_len == leader_len < len(prompt) + 20


def test_every_beam_waits_for_the_others_when_the_budget_splits_them():
    s = make_scheduler(budget=3)
    params = BeamSearchParams(8, 6, ignore_eos=True)
    prompt = [7, 8, 9]
    group = beam_request(s, "a", prompt, params).beam
    steps = run(s, [group])
    assert results(group) == reference(prompt, params)
    assert steps >= 1 + 5 * 8 // 3  # 8 decodes a round, 3 a step


def test_a_group_shares_its_blocks():
    """Peak blocks of a group of 8 beams on a 40-token prompt: far below 8 separate sequences."""
    s = make_scheduler(block_size=4)
    params = BeamSearchParams(8, 8, ignore_eos=True)
    beam_request(s, "a", list(range(3, 43)), params)
    peak = 0
    while s.has_unfinished_requests():
        fake_step(s)
        peak = max(peak, s.kv.pool.num_used_blocks)
    separate = 8 * -(-(40 + 8) // 4)
    assert peak <= 10 + 8 * 3 < separate / 2


def test_abort_frees_every_beam():
    s = make_scheduler(num_blocks=40)
    group = beam_request(s, "a", list(range(3, 20)), BeamSearchParams(4, 30, ignore_eos=True)).beam
    for _ in range(5):
        fake_step(s)
    assert len(s.running) == 4
    s.finish_request(group.request, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.kv.pool.num_used_blocks == 0
    assert group.finished and group.request.status == RequestStatus.FINISHED_ABORTED


def test_groups_that_could_never_run_are_refused():
    s = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="beam_width=16 is larger than max_num_seqs=8"):
        beam_request(s, "a", [5, 6, 7], BeamSearchParams(16, 4))
    with pytest.raises(ValueError, match="may need .* KV blocks, more than the pool's 20"):
        beam_request(s, "b", [5] * 30, BeamSearchParams(8, 40))
    assert not s.has_unfinished_requests()
