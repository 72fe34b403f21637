"""What the engine and the platforms use of a model class (`LlamaForCausalLM` is one)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvserve.kernels.decoder import LayerWeights
from kvserve.layers.attention.backend import AttentionMetadata
from kvserve.models.config import ModelConfig


class CausalLM(Protocol):
    config: ModelConfig
    # checkpoint tensors stacked into one parameter of ours, e.g. qkv_proj: (q_proj, k_proj, v_proj)
    packed_modules_mapping: dict[str, tuple[str, ...]]
    layer_loop: Any  # a platform's compiled loop over the decoder layers, or None

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of every token in the flat batch: [num_tokens, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_tokens(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor | None:
        """The argmax of compute_logits(hidden) outside `banned`, where the head can fuse it; else None."""

    def pack_linears(self) -> None:
        """Pre-pack every projection and the head for the CPU (after loading)."""

    def decoder_layer_weights(self) -> list[LayerWeights] | None:
        """Each layer's weights for a compiled layer loop, or None where its layers need more."""
