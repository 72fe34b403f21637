"""Tokenizer and chat template (transformers')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
