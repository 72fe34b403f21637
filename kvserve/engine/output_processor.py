"""From sampled tokens to `RequestOutput`s: detokenize, stop strings, gather n samples.

A beam-search request has one output, when its search ends: its best hypotheses, decoded then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.engine.beam_group import BeamGroup
from kvserve.engine.request import Request
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.stop_strings import find_stop, holdback


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    stop_reason: int | str | None = None
    stop_at: int | None = None  # text length to cut at, once a stop string matched


@dataclass
class RequestGroup:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    samples: dict[int, SampleState] = field(default_factory=dict)
    beam: BeamGroup | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.finished
        return len(self.samples) == self.n and all(s.request.status.finished for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}

    def add_group(self, request: Request, prompt: str | None) -> None:
        group = RequestGroup(
            request.group_id, prompt, request.prompt_token_ids, request.sampling_params.n, beam=request.beam
        )
        self.groups[request.group_id] = group
        self._track(group, request)

    def _track(self, group: RequestGroup, req: Request) -> SampleState:
        if req.sample_index not in group.samples:
            detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, req.sampling_params.skip_special_tokens)
            group.samples[req.sample_index] = SampleState(req, detok)
        return group.samples[req.sample_index]

    def update_text(self, updated: list[Request]) -> list[Request]:
        """Detokenize each new token; returns the requests a stop string has just ended."""
        stopped = []
        for req in updated:
            if req.beam is not None:  # beams change every step: decoded only when the search ends
                continue
            state = self._track(self.groups[req.group_id], req)
            delta = state.detokenizer.step(req.output_token_ids[-1])
            if req.status.finished:
                state.stop_reason = _stop_token(req)
            elif delta and req.num_output_tokens >= req.sampling_params.min_tokens:
                if _match_stop_string(state, len(delta)):
                    stopped.append(req)
        return stopped

    def make_outputs(self, updated: list[Request]) -> list[RequestOutput]:
        groups = [self.groups[g] for g in dict.fromkeys(r.group_id for r in updated)]
        outputs = [self.make_output(g) for g in groups if g.beam is None or g.finished]
        for out in outputs:
            if out.finished:
                del self.groups[out.request_id]
        return outputs

    def make_output(self, group: RequestGroup) -> RequestOutput:
        if group.beam is not None:
            completions = self._beam_completions(group.beam) if group.finished else []
        else:
            completions = [self._completion(i, s) for i, s in sorted(group.samples.items())]
        first = group.samples[0].request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=_metrics(first),
            kv_transfer_params=_handoff(first),
            prompt_logprobs=self._prompt_logprobs(first),
        )

    def drop(self, group_id: str) -> RequestGroup | None:
        return self.groups.pop(group_id, None)

    def _completion(self, index: int, state: SampleState) -> CompletionOutput:
        req = state.request
        text = state.detokenizer.text
        if state.stop_at is not None:
            text = text[: state.stop_at]
        elif not req.status.finished:
            text = text[: len(text) - holdback(text, req.sampling_params.stop_strings)]
        logprobs, cumulative = None, None
        if req.sampling_params.logprobs is not None:
            logprobs = [self._decode_logprobs(lp) for lp in req.output_logprobs]
            cumulative = sum(lp[t].logprob for lp, t in zip(logprobs, req.output_token_ids, strict=True))
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.value if req.status.finished else None,
            stop_reason=state.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
        )

    def _beam_completions(self, group: BeamGroup) -> list[CompletionOutput]:
        skip = group.request.sampling_params.skip_special_tokens
        stop_ids = set(group.params.stop_token_ids)
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=skip),
                token_ids=list(h.token_ids),
                finish_reason="stop" if h.eos else "length",
                stop_reason=h.token_ids[-1] if h.eos and h.token_ids[-1] in stop_ids else None,
                cumulative_logprob=h.cumulative_logprob,
                score=h.score,
            )
            for i, h in enumerate(group.results())
        ]

    def _prompt_logprobs(self, req: Request) -> list[dict[int, Logprob] | None] | None:
        if req.sampling_params.prompt_logprobs is None:
            return None
        return [None if lp is None else self._decode_logprobs(lp) for lp in req.prompt_logprobs]

    def _decode_logprobs(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        if all(lp.decoded_token is not None for lp in entry.values()):
            return entry
        decoded = {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t])) for t, lp in entry.items()}
        entry.update(decoded)  # decode once, not at every output
        return entry


def _match_stop_string(state: SampleState, delta_len: int) -> bool:
    """Look for a stop string ending in the new text; remember where to cut."""
    sp = state.request.sampling_params
    found = find_stop(state.detokenizer.text, sp.stop_strings, delta_len, sp.include_stop_str_in_output)
    if found is not None:
        state.stop_reason, state.stop_at = found
    return found is not None


def _stop_token(req: Request) -> int | None:
    last = req.output_token_ids[-1]
    return last if last in req.sampling_params.stop_token_ids else None


def _metrics(req: Request) -> RequestMetrics:
    t = req.times
    return RequestMetrics(
        arrival_time=t.arrival,
        queue_time=None if t.first_scheduled is None else t.first_scheduled - t.arrival,
        time_to_first_token=None if t.first_token is None else t.first_token - t.arrival,
        decode_time=None if t.finished is None or t.first_token is None else t.finished - t.first_token,
        num_preemptions=req.num_preemptions,
    )


def _handoff(request: Request) -> dict[str, Any] | None:
    """vLLM's do_remote_prefill answer, once a prefill replica holds the blocks (the server adds
    its engine id and address)."""
    if request.remote_block_ids is None:
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": request.request_id,
        "remote_block_ids": request.remote_block_ids,
    }
