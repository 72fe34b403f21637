"""kvserve: an LLM serving engine built around the KV cache.

`LLM` and the output types are loaded on first use (PEP 562), so `import kvserve.x` of a
module that needs no torch (the config, the KV cache, the HTTP protocol, a router) does
not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.entrypoints.llm import LLM
    from kvserve.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
    from kvserve.sampling_params import BeamSearchParams, SamplingParams

_EXPORTS = {
    "LLM": "kvserve.entrypoints.llm",
    "SamplingParams": "kvserve.sampling_params",
    "BeamSearchParams": "kvserve.sampling_params",
    "BeamSearchOutput": "kvserve.outputs",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
    "Logprob": "kvserve.outputs",
}
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
