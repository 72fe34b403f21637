"""A beam group: the live beams of one beam-search request, sharing KV blocks by copy-on-write.

Each live beam is a request of its own to the scheduler and the model runner: a block table,
one decode token per step, batched with everyone else's requests. The model runner gives each
beam its best candidates of the log-softmax of its last token's logits; once every live beam
has them, `advance` runs one `BeamSearch` step and maps it onto the KV cache manager: the
first new beam extending an old beam takes the old beam's request and block table, every other
one forks it (sharing all its blocks, the partly filled last one too, which the scheduler
copies only when a beam writes to it), and old beams nothing extends are freed at once. A
group starts as one request, the prompt; its first step forks the prompt's blocks into the beams.

Preemption takes every beam's blocks. The group resumes through one beam, the leader, which
recomputes the history all live beams share (the prompt and their common output tokens); then
the others fork from it and each computes only its own tokens (`resume_len`). Beams hold no
state besides their tokens, so a resumed group continues exactly where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.engine.beam_search import BeamSearch, Hypothesis
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, cdiv
from kvserve.sampling_params import BeamSearchParams, SamplingParams

# what a beam's request carries: beams are chosen by the group, never sampled or stopped on their own
BEAM_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


class Beam(Protocol):
    """What a group needs of a beam (`engine.request.Request` is one)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    block_keys: list[bytes]

    @property
    def num_tokens(self) -> int: ...

    def append_output_token(self, token_id: int, logprobs: None) -> None: ...

    def fork_beam(self) -> Beam: ...


@dataclass(frozen=True)
class BeamChange:
    beams: list[Beam]  # the live beams now, in the search's order
    dropped: list[Beam]  # beams that left the group; their blocks are freed
    grew: bool  # each live beam got a token (a search step, not a resume's fork)


def max_new_tokens(params: BeamSearchParams, num_prompt_tokens: int, max_total_tokens: int) -> int:
    return max(1, min(params.max_tokens, max_total_tokens - num_prompt_tokens))


def max_blocks(params: BeamSearchParams, num_prompt_tokens: int, max_new: int, block_size: int) -> int:
    """The most blocks a group ever holds (resuming included): the prompt's full blocks shared,
    the rest, up to the last token's block, once per beam."""
    shared = num_prompt_tokens // block_size
    return shared + 1 + params.beam_width * (cdiv(num_prompt_tokens + max_new, block_size) - shared)


class BeamGroup:
    def __init__(self, request: Beam, params: BeamSearchParams, eos_token_ids: tuple[int, ...], max_total_tokens: int):
        eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.params = params
        self.search = BeamSearch(
            params.beam_width,
            max_new_tokens(params, len(request.prompt_token_ids), max_total_tokens),
            eos,
            params.length_penalty,
            params.early_stopping,
            params.num_return_sequences,
        )
        self.request = request  # the user's request: outputs, metrics and aborts go by it
        self.beams: list[Beam] = [request]
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by seq_id: this round's candidates
        self.resume_len: int | None = None  # while the leader recomputes the shared history
        self.finished = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    def results(self) -> list[Hypothesis]:
        return self.search.results()

    def add_candidates(self, beam: Beam, candidates: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """A beam's candidates for its next token (logprobs, token ids); True once the group can advance."""
        if self.resume_len is not None:  # the leader computed the shared history (its row is not needed)
            return True
        self.rows[beam.seq_id] = candidates
        return len(self.rows) == len(self.beams)

    def advance(self, kv: KVCacheManager) -> BeamChange:
        return self._fork_resumed(kv) if self.resume_len is not None else self._select(kv)

    def _select(self, kv: KVCacheManager) -> BeamChange:
        old = self.beams
        values, tokens = zip(*(self.rows.pop(b.seq_id) for b in old), strict=True)
        step = self.search.step(torch.stack(values), torch.stack(tokens))
        if step.done:
            for beam in old:
                kv.free(beam)
            self.beams, self.finished = [], True
            return BeamChange([], old, grew=False)
        kept: set[int] = set()
        new = []
        for p in step.parents:  # all forks before any append: a fork copies the history up to now
            if p in kept:
                child = old[p].fork_beam()
                kv.fork(old[p], child)
            else:
                child = old[p]
                kept.add(p)
            new.append(child)
        for beam, token in zip(new, step.tokens, strict=True):
            beam.append_output_token(token, None)
        dropped = [b for i, b in enumerate(old) if i not in kept]
        for beam in dropped:
            kv.free(beam)
        self.beams = new
        return BeamChange(new, dropped, grew=True)

    def preempt(self) -> Beam:
        """After every beam's blocks were freed: the request to queue, the leader. With several
        live beams it holds only their shared history (at least one token short of its own)."""
        self.rows.clear()
        for beam in self.beams:
            beam.num_computed_tokens = 0
            beam.all_token_ids = beam.prompt_token_ids + beam.output_token_ids  # undo a resume in progress
        leader = self.beams[0]
        self.resume_len = None
        if len(self.beams) > 1:
            shared = _common_prefix_len([b.all_token_ids for b in self.beams])
            self.resume_len = min(shared, leader.num_tokens - 1)
            leader.all_token_ids = leader.all_token_ids[: self.resume_len]
        return leader

    def _fork_resumed(self, kv: KVCacheManager) -> BeamChange:
        """The leader holds the shared history: the other beams fork it and go on from there."""
        leader = self.beams[0]
        leader.all_token_ids = leader.prompt_token_ids + leader.output_token_ids
        for beam in self.beams[1:]:
            beam.num_computed_tokens = leader.num_computed_tokens
            kv.fork(leader, beam)
        self.resume_len = None
        return BeamChange(list(self.beams), [], grew=False)

    def blocks_after_admission(self, kv: KVCacheManager) -> int:
        """Blocks the beams take beyond the leader's own right after it is admitted (an upper
        bound), in every KV group: each beam's block for its next token (a copy-on-write copy
        or a new one), and after a preemption, its own tokens past the shared history too
        (in a window group, those its window still sees)."""
        if self.resume_len is None:
            last = self.search.num_generated + 1 >= self.search.max_new_tokens
            return 0 if last else self.width * (1 + len(kv.groups))  # the leader's logits end the search
        bs, length = kv.block_size, len(self.beams[0].prompt_token_ids) + self.search.num_generated
        shared, blocks = self.resume_len // bs, cdiv(length + 1, bs)
        # the first group keeps all its blocks; a window group only those its window still sees
        own = blocks - shared + sum(blocks - max(shared, g.first_needed_block(length, bs)) for g in kv.groups)
        return len(self.beams) * own

    def block_ids(self, kv: KVCacheManager) -> set[int]:
        """The blocks the group holds: the union of its live beams' tables."""
        return {i for beam in self.beams for i in kv.block_ids(beam)}


def _common_prefix_len(seqs: list[list[int]]) -> int:
    n = min(map(len, seqs))
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n
