"""Rotary position embedding (rotate-half layout, as Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported yet")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, smooth between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, out)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.max_position = max_position
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute cos/sin; also after the model was built on the meta device."""
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float64, device="cpu"), self.inv_freq)
        # cos and sin side by side: one gather per layer instead of two; cast with the model
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(self.cos_sin.device)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, head_dim]: each token's cos, then its sin; once per forward, shared by every layer."""
        return self.cos_sin[positions]
