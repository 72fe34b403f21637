"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and
`.beam_search(prompts, BeamSearchParams(...))`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams
from kvserve.tokenizer import apply_chat_template

Prompt = str | list[int]
Params = SamplingParams | BeamSearchParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        config = EngineConfig(**kwargs) if model is None else EngineConfig(model=model, **kwargs)
        self.llm_engine = LLMEngine(config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A BeamSearchParams
        among the params gives that prompt's best beams as its completions."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params")
        return self._run(self._add_all(prompts, params_list), use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search inside the engine (beams share KV blocks), as transformers' `generate(num_beams=...)`
        scores it; each output's sequences are the best finished beams, best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        outputs = self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)
        return [_beam_output(out) for out in outputs]

    def _add_all(self, prompts: list[Prompt], params_list: list[Params]) -> list[str]:
        ids = []
        try:
            for prompt, sp in zip(prompts, params_list, strict=True):
                ids.append(self.llm_engine.add_request(prompt, sp))
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call, leaving the engine clean
                self.llm_engine.abort_request(rid)
            raise
        return ids

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = [apply_chat_template(tok, conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while self.llm_engine.has_unfinished_requests():
                    for out in self.llm_engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:  # a failed step (or Ctrl-C) ends the whole call, leaving the engine clean
                for rid in ids:
                    self.llm_engine.abort_request(rid)
                raise
        return [finished[i] for i in ids]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # one prompt (text or token ids)
    return list(prompts)


def _beam_output(out: RequestOutput) -> BeamSearchOutput:
    prompt = out.prompt_token_ids
    sequences = [
        BeamSearchSequence(
            tokens=prompt + c.token_ids,
            cum_logprob=c.cumulative_logprob,
            score=c.score,
            text=c.text,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return BeamSearchOutput(sequences, list(prompt))
