"""Workloads where prefixes repeat: multi-turn ShareGPT chats and a shared long prefix."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.bench.datasets import BenchRequest, iter_json_array, sharegpt_path


@dataclass(frozen=True)
class Conversation:
    user_turns: list[str]
    reply_tokens: list[int]  # output length of each turn: the reference reply's token count


def _alternating(record: Any) -> list[str]:
    """The messages of a human/gpt/human/gpt... conversation, up to the first break in the pattern."""
    turns = (record.get("conversations") or []) if isinstance(record, dict) else []
    texts = []
    for i, turn in enumerate(turns):
        if turn.get("from") != ("human" if i % 2 == 0 else "gpt") or not turn.get("value"):
            break
        texts.append(turn["value"])
    return texts[: len(texts) // 2 * 2]


def _conversations(records: Iterator[Any]) -> Iterator[list[str]]:
    for record in records:
        texts = _alternating(record)
        if len(texts) >= 4:  # at least two turns: the second can reuse the first
            yield texts


def sample_multiturn(
    tokenizer: PreTrainedTokenizerBase,
    num_conversations: int,
    seed: int,
    max_turns: int = 4,
    max_reply_tokens: int = 128,
    max_message_tokens: int = 256,
) -> list[Conversation]:
    """ShareGPT chats of 2+ turns; long messages are skipped so histories fit a 2k context."""
    chats = list(_conversations(iter_json_array(sharegpt_path().read_text(encoding="utf-8"))))
    random.Random(seed).shuffle(chats)
    picked: list[Conversation] = []
    for texts in chats:
        if len(picked) == num_conversations:
            break
        lengths = [len(tokenizer.encode(t, add_special_tokens=False, verbose=False)) for t in texts[: 2 * max_turns]]
        if max(lengths) > max_message_tokens:
            continue
        users, replies = texts[0 : 2 * max_turns : 2], lengths[1 : 2 * max_turns : 2]
        picked.append(Conversation(users, [min(max(n, 4), max_reply_tokens) for n in replies]))
    if len(picked) < num_conversations:
        raise ValueError(f"only {len(picked)} ShareGPT conversations fit, asked for {num_conversations}")
    return picked


def shared_prefix_requests(
    vocab_size: int, num_requests: int, prefix_len: int, suffix_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """One random prefix shared by all requests, then a random suffix of each request's own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)], output_len)
        for _ in range(num_requests)
    ]
