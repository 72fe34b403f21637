"""Tokenizer, chat template and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class IncrementalDetokenizer:
    """Text of one sample, grown a token at a time (multi-byte characters wait for their last byte)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        delta = self._stream.step(self._backend, token_id) or ""
        self.text += delta
        return delta
