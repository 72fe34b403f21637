"""kvserve: an LLM serving engine built around the KV cache."""

from kvserve.entrypoints.llm import LLM
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
