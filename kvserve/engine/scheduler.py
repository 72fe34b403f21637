"""Continuous batching: which requests run this step, and how many tokens each.

Every request carries `num_computed_tokens`; a step gives each scheduled request
some of its remaining tokens, under a token budget. There are no separate prefill
and decode phases: a decode is a request with one token left, a chunked prefill
one with many. Running requests go first (in admission order), then waiting ones
are admitted while the budget, the sequence cap and the block pool allow (with
`prefill_first`, SGLang's policy, a step that can admit new prompts runs only
their prefills, and the running requests wait for the next step). When
blocks run out, the most recently admitted running request is preempted: its
blocks are freed and it goes back to the head of the queue to be recomputed.

With KV tiers, a waiting request whose blocks must come from disk or Redis leaves
the queue for `loading` (vLLM's waiting-for-remote-KV state) while the others keep
running, and returns to the head of the queue when they arrive, fail or time out. A load
that ends within a quarter of a step (`LOAD_WAIT_SHARE`, at most `LOAD_WAIT_MAX` per
step) is waited for instead: leaving the queue would cost its request a whole step,
while a page-cached disk read of a long history takes 5-20 ms; the others lose at most
that much of one step (half a step was measured no better).

Beam search (`beam_group.py`): each live beam is a running request; a group is admitted only
with room for all its beams (seats and blocks), its beams stay next to each other in
`running`, it advances once every beam has its logprobs, and it is preempted as a whole.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.engine.beam_group import BeamGroup, max_blocks
from kvserve.engine.request import Request, RequestStatus
from kvserve.kv_cache.kv_cache_manager import BlockCopy, BlockLoad, BlockSave, KVCacheManager, PrefixHit
from kvserve.layers.sampler import SampledToken

LOAD_WAIT_SHARE = 0.25  # of the time between two steps
LOAD_WAIT_MAX = 0.02  # seconds per step


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    prefill_first: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool = False  # the chunk reaches the last token: its logits give the next token

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, new sibling)
    block_copies: list[BlockCopy] = field(default_factory=list)
    block_saves: list[BlockSave] = field(default_factory=list)  # read out before the forward overwrites them
    block_loads: list[BlockLoad] = field(default_factory=list)  # written before the forward reads them
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # waiting for blocks from the KV tiers
        self.num_preemptions = 0
        self._last_schedule = time.monotonic()
        self._load_wait_until = 0.0

    @property
    def max_total_tokens(self) -> int:
        """The longest a request may grow: the context length, and never more than the pool."""
        return min(self.config.max_model_len, self.kv.num_tokens_capacity)

    def check_prompt(self, num_prompt_tokens: int, n: int, n_name: str = "n") -> None:
        """Reject what could never run, instead of queueing it forever."""
        if num_prompt_tokens == 0:
            raise ValueError("prompt must not be empty")
        if num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens, longer than max_model_len={self.config.max_model_len}"
            )
        if num_prompt_tokens > self.kv.num_tokens_capacity:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens, more than the whole KV cache holds "
                f"({self.kv.num_tokens_capacity} tokens); raise kv_cache_memory"
            )
        if n > self.config.max_num_seqs:
            raise ValueError(f"{n_name}={n} is larger than max_num_seqs={self.config.max_num_seqs}")

    def add_request(self, request: Request) -> None:
        if request.beam is not None:
            self.check_beam_group(request.beam, request.num_prompt_tokens)
        else:
            self.check_prompt(request.num_prompt_tokens, request.sampling_params.n)
        request.max_total_tokens = self.max_total_tokens
        self.waiting.append(request)

    def check_beam_group(self, group: BeamGroup, num_prompt_tokens: int) -> None:
        """A group must fit the pool alone at its largest, or it could be preempted forever."""
        self.check_prompt(num_prompt_tokens, group.width, "beam_width")
        need = max_blocks(group.params, num_prompt_tokens, group.search.max_new_tokens, self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"beam search with beam_width={group.width}, a {num_prompt_tokens}-token prompt and "
                f"max_tokens={group.search.max_new_tokens} may need {need} KV blocks, more than the pool's "
                f"{self.kv.pool.num_blocks}; lower beam_width or max_tokens, or raise kv_cache_memory"
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        now = time.monotonic()
        self._load_wait_until = now + min(LOAD_WAIT_MAX, LOAD_WAIT_SHARE * (now - self._last_schedule))
        self._last_schedule = now
        self._return_loaded()
        if self.config.prefill_first and not self._chunk_in_progress():
            # a new prompt's first token then waits for its prefill alone, not for the
            # decodes of every running request too; those wait one step instead. Whole
            # prompts only, so a chunked one still comes last and never delays a decode.
            self._schedule_waiting(budget, out, whole_prompts=True)
        if not out.scheduled:
            budget = self._schedule_running(budget, out)
            if not out.preempted:  # under memory pressure, admit nobody new this step
                self._schedule_waiting(budget, out)
        self._fork_samples(out)
        out.block_copies = self.kv.take_pending_copies()
        out.block_saves = self.kv.take_pending_saves()
        out.block_loads = self.kv.take_pending_loads()
        return out

    def _return_loaded(self) -> None:
        """Requests whose tier loads are over go back to the head of the queue, in order."""
        ready = [r for r in self.loading if self.kv.load_ready(r)]
        for req in reversed(ready):
            self.loading.remove(req)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self.kv.fitting_tokens(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # a beam with its logprobs, waiting for its group's others
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victims = self._preempt(self.running.pop())  # the most recently admitted (its whole beam group)
                out.preempted.extend(victims)
                if req in victims:
                    return budget + self._unschedule(out, victims)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, out: SchedulerOutput, whole_prompts: bool = False) -> None:
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self._num_seats() + self._seats(req) > self.config.max_num_seqs:
                break
            hit = None if req.skip_reading_prefix_cache else self.kv.match_prefix(req)
            if self.kv.start_load(req, hit) and not self.kv.wait_for_load(req, self._load_wait_until):
                self.waiting.popleft()
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading.append(req)
                continue
            hit, loaded = self.kv.loaded_blocks(req, hit)
            cached = (hit.num_blocks if hit else 0) * self.kv.block_size
            computed = cached + len(loaded) * self.kv.block_size  # loads take blocks, not budget
            n = self.kv.fitting_tokens(req, min(req.num_tokens - computed, budget), hit, computed - cached)
            if whole_prompts and n < req.num_tokens - computed:
                break
            if req.beam is not None and not self._beam_group_fits(req, hit, cached):
                break
            if not self.kv.allocate_slots(req, computed - cached + n, hit):
                break
            self.kv.queue_loads(req, cached // self.kv.block_size, loaded)
            self.waiting.popleft()
            self._record_prefix_hit(req, cached, computed)
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled is None:
                req.times.first_scheduled = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _beam_group_fits(self, req: Request, hit: PrefixHit | None, cached: int) -> bool:
        """Blocks for the leader's whole prompt (every chunk) and for its beams' next tokens."""
        need = self.kv.blocks_needed(req, req.num_tokens - cached, hit)
        return need + req.beam.blocks_after_admission(self.kv) <= self.kv.pool.num_available_blocks

    def _chunk_in_progress(self) -> bool:
        """A running prompt is part-way through its prefill (only ever the last one)."""
        return bool(self.running) and self.running[-1].num_tokens - self.running[-1].num_computed_tokens > 1

    def _record_prefix_hit(self, req: Request, cached: int, computed: int) -> None:
        """`cached` tokens from the device pool; up to `computed`, loaded from the tiers."""
        req.num_computed_tokens = computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        stats = self.kv.prefix_stats
        stats.queries += req.num_tokens
        stats.hits += cached
        if self.kv.store is not None:
            stats.external_queries += req.num_tokens - cached
            stats.external_hits += computed - cached

    @staticmethod
    def _seats(req: Request) -> int:
        """Running slots a request takes, counting siblings it has yet to fork (a beam group: its width)."""
        if req.beam is not None:
            return req.beam.width
        return req.sampling_params.n if req.needs_fork else 1

    def _num_seats(self) -> int:
        groups = {id(r.beam): r.beam for r in self.running if r.beam is not None}  # its width, whatever is live
        return sum(self._seats(r) for r in self.running if r.beam is None) + sum(g.width for g in groups.values())

    def _fork_samples(self, out: SchedulerOutput) -> None:
        """n > 1: once the prompt's last chunk is scheduled, its siblings share its blocks."""
        for s in out.scheduled:
            parent = s.request
            if s.samples and parent.needs_fork:
                children = [parent.fork(index) for index in range(1, parent.sampling_params.n)]
                for child in children:
                    child.status = RequestStatus.RUNNING
                    self.kv.fork(parent, child)
                    out.forks.append((parent, child))
                # right after the parent, so that only the last running request can be
                # mid-prefill and decodes keep going first
                at = self.running.index(parent) + 1
                self.running[at:at] = children

    def _preempt(self, req: Request) -> list[Request]:
        """Free a request's blocks and queue it first, to be recomputed; a beam, with its whole group."""
        if req.beam is not None:
            return self._preempt_beam_group(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return [req]

    def _preempt_beam_group(self, popped: Request) -> list[Request]:
        group = popped.beam
        victims = [popped, *reversed([r for r in self.running if r.beam is group])]  # from the back, as one
        self.running[:] = [r for r in self.running if r.beam is not group]
        for beam in victims:
            self.kv.free(beam)
            beam.status = RequestStatus.WAITING
            beam.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(group.preempt())  # its leader: the others wait in the group
        return victims

    @staticmethod
    def _unschedule(out: SchedulerOutput, victims: list[Request]) -> int:
        """Drop this step's chunks of requests just preempted; returns the budget they took."""
        gone = [s for s in out.scheduled if s.request in victims]
        out.scheduled = [s for s in out.scheduled if s.request not in victims]
        return sum(s.num_new_tokens for s in gone)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, SampledToken]) -> list[Request]:
        """Advance progress, append sampled tokens, finish what stopped; returns requests that got a token."""
        updated = []
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)
        for parent, child in out.forks:
            child.num_computed_tokens = parent.num_computed_tokens
        beam_groups: dict[BeamGroup, None] = {}
        for req in [s.request for s in out.scheduled if s.samples] + [c for _, c in out.forks]:
            token = sampled[req.seq_id]
            if req.beam is not None:
                if req.beam.add_candidates(req, token.beam_candidates):
                    beam_groups[req.beam] = None
                continue
            req.append_output_token(token.token_id, token.logprobs)
            if req.times.first_token is None:
                req.times.first_token = time.monotonic()
            status = self._check_stop(req)
            if status is not None:
                self.finish_request(req, status)
            updated.append(req)
        for group in beam_groups:
            updated.extend(self._advance_beam_group(group))
        return updated

    def _advance_beam_group(self, group: BeamGroup) -> list[Request]:
        """Apply the group's step: its new live beams take the old ones' place in `running`;
        returns the beams that got a token (or, at the end, the group's request)."""
        at = next(i for i, r in enumerate(self.running) if r.beam is group)
        change = group.advance(self.kv)
        self.running[at:] = [r for r in self.running[at:] if r.beam is not group]
        self.running[at:at] = change.beams
        for beam in change.dropped:
            beam.status = RequestStatus.FINISHED_STOPPED  # pruned; its blocks are free already
        for beam in change.beams:
            beam.status = RequestStatus.RUNNING
        times = group.request.times
        if change.grew and times.first_token is None:
            times.first_token = time.monotonic()
        if not group.finished:
            return change.beams if change.grew else []
        best = group.results()
        group.request.status = RequestStatus.FINISHED_STOPPED if best and best[0].eos else RequestStatus.FINISHED_LENGTH
        times.finished = time.monotonic()
        return [group.request]

    def _check_stop(self, req: Request) -> RequestStatus | None:
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if (not sp.ignore_eos and last in req.eos_token_ids) or last in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Stop a request now (stop condition, stop string or abort) and free its blocks."""
        if req.beam is not None:
            self._abort_beam_group(req.beam, status)
            return
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.loading.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.times.finished = time.monotonic()
        if req.kv_lease and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            req.remote_block_ids = self.kv.hold(req.request_id, req, req.kv_lease)
        self.kv.free(req)

    def _abort_beam_group(self, group: BeamGroup, status: RequestStatus) -> None:
        """Any of its beams (or its request) stops the whole group."""
        if group.finished:
            return
        for beam in group.beams:
            for queue in (self.running, self.waiting, self.loading):  # a preempted group's others are in none
                if beam in queue:
                    queue.remove(beam)
            beam.status = status
            self.kv.free(beam)
        group.beams, group.finished = [], True
        group.request.status = status
        group.request.times.finished = time.monotonic()

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        for req in requests:
            self.finish_request(req, status)
