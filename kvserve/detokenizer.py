"""Incremental detokenization: a sample's text grown a token at a time, as a client is sent it.
Only `tokenizers` (no transformers, no torch): the engine's output processor and the router's
text stage (a migrated stream) decode alike."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Text of one sample, grown a token at a time (multi-byte characters wait for their last byte)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self.text += delta
        return delta
