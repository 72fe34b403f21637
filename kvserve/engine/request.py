"""A request as the scheduler sees it: tokens, progress, sampling state, timings."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from kvserve.outputs import Logprob
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.beam_group import BeamGroup

_seq_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its cached blocks are on their way from a tier
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step that computed it raised

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING)


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 1 << 30  # context limit: min(max_model_len, whole pool)
    extra_key: bytes = b""  # partitions the prefix cache: digest of tenant salt, adapter
    block_keys: list[bytes] = field(default_factory=list)  # chained keys of full blocks, kept by the KV cache
    group_id: str = ""  # the user's request id; n > 1 samples share it
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # with sampling_params.prompt_logprobs: an entry per prompt position done so far (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    times: RequestTimes = field(default_factory=RequestTimes)
    generator: torch.Generator | None = field(default=None, repr=False)
    beam: BeamGroup | None = field(default=None, repr=False)  # beam search: the group this beam is in
    # a prefill replica's handoff (kv_transfer_params do_remote_decode): seconds to hold the
    # finished prompt's blocks for the decode replica, and the ids of the blocks it held
    kv_lease: float = 0.0
    remote_block_ids: list[int] | None = None
    seq_id: int = field(init=False)  # unique per sample; what block tables are keyed by

    def __post_init__(self) -> None:
        self.seq_id = next(_seq_ids)
        self.group_id = self.group_id or self.request_id
        self.all_token_ids = list(self.prompt_token_ids) + self.output_token_ids
        seed = self.sampling_params.seed
        if seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed((seed + self.sample_index) % 2**64)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's rule: prompt logprobs need the logits of every prompt position, which a prefix
        hit would skip, so such a request computes its whole prompt (until it has them all: a
        preempted one may then resume from the cache). Its blocks are still cached for others."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def needs_fork(self) -> bool:
        """A parent of n > 1 samples that has not produced its first token yet."""
        return self.sampling_params.n > 1 and self.sample_index == 0 and not self.output_token_ids

    def append_output_token(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def fork(self, sample_index: int) -> Request:
        """A sibling sample sharing the prompt (its blocks are shared by the KV cache manager)."""
        return replace(
            self,
            request_id=f"{self.group_id}-{sample_index}",
            sample_index=sample_index,
            output_token_ids=[],
            output_logprobs=[],
            prompt_logprobs=list(self.prompt_logprobs),  # the output reports the first sample's
            block_keys=list(self.block_keys),
            times=replace(self.times),
            generator=None,
        )

    def fork_beam(self) -> Request:
        """Another beam continuing this one's history (the KV cache manager shares its blocks)."""
        child = replace(
            self,
            sample_index=1,  # only the group's first request counts as its prompt's in the stats
            output_token_ids=list(self.output_token_ids),
            output_logprobs=[],
            prompt_logprobs=[],
            block_keys=list(self.block_keys),
            generator=None,
        )
        child.request_id = f"{self.group_id}-beam{child.seq_id}"
        return child
