"""What `LLM.generate` returns, shaped as vLLM's `RequestOutput`; `LLM.beam_search`, as vLLM's `BeamSearchOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timings in seconds, from `time.monotonic()`."""

    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    time_to_first_token: float | None = None  # arrival -> first token
    decode_time: float | None = None  # first token -> finish
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # a prefill replica's answer to do_remote_decode (vLLM's): where the decode side pulls the blocks
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: None for the first prompt token, then each one's logprob with the top k, when asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One returned beam, as in vLLM: `tokens` are the prompt's and then the generated ones
    (EOS included); `text` is the generated text alone."""

    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty, transformers' sequences_scores
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int]
