"""Which class runs which architecture: the checkpoint's architecture name (`model_type` in
a Hugging Face config.json, `general.architecture` in a GGUF file) -> module and class.

Adding an architecture is one module beside this one and one line here. Classes are
imported when first asked for, so reading a config needs no model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "LlamaForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),  # bias on q/k/v
    "qwen3": ("llama", "LlamaForCausalLM"),  # RMSNorm on each head of q and k
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),  # sliding window on 5 of every 6 layers
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),  # a GGUF file's general.architecture
}


def check_supported(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported yet (supported: {', '.join(_MODELS)})")


def model_class(architecture: str) -> Any:
    check_supported(architecture)
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"kvserve.models.{module}"), name)
