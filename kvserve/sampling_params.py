"""Sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5  # below this temperature sampling is greedy, as in vLLM
MAX_LOGPROBS = 20
# A beam of a million tokens stays within the float range at length ** 50 (1e300).
# transformers and vLLM take any value; a huge one here divided by 0.0 in the engine thread.
MAX_LENGTH_PENALTY = 50


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen one is added)
    # top-k logprobs per prompt token after the first (the actual one is added); 0: the actual one only
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: dict[str, Any] | None = None  # vLLM's: "kv_transfer_params" (prefill/decode handoff)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.stop, str | list | tuple | None):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list | tuple | None):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _verify(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)


@dataclass
class BeamSearchParams:
    """Beam search (`LLM.beam_search`), named as in vLLM and scored as in Hugging Face
    transformers' `generate(num_beams=beam_width, do_sample=False, ...)`."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # finished beams score sum_logprobs / generated_len ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end a beam as EOS does (transformers: more eos_token_id)
    num_return_sequences: int | None = None  # the best finished beams returned; None: beam_width

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, lo=1)
        _check_int("max_tokens", self.max_tokens, lo=1)
        lp = self.length_penalty
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        if abs(lp) > MAX_LENGTH_PENALTY:  # length ** it would leave the float range, and a score with it
            raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got {lp!r}")
        if not any(self.early_stopping is v for v in (True, False)) and self.early_stopping != "never":
            raise ValueError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}')
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if self.num_return_sequences is not None:
            _check_int("num_return_sequences", self.num_return_sequences, lo=1, hi=self.beam_width)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_number(name: str, value: object, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi) or value == float("inf"):
        left = "(" if lo_open else "["
        bound = f"in {left}{lo}, {hi}]" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
        raise ValueError(f"{name} must be {bound}, got {value}")
