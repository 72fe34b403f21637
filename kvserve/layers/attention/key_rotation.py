"""Int8 keys in a rotated basis, for models whose queries and keys pass per-channel gains (q/k_norm).

A k_norm multiplies each key channel by a learned gain, and Gemma 3's reach 30 against a median
of 2: a few channels then span most of a (token, head) row's range, and one scale per row leaves
the other channels a handful of codes (KL 3.0e-3 against fp32 K/V at 512 tokens). Attention only
needs q . k, and q . k = (q diag(s) H) . (k diag(1/s) H) for the orthonormal Hadamard matrix H
and any positive s, so the keys are stored, and the queries multiplied, in that basis. H spreads
every channel over all of them, so a row's range follows its norm; a score's error then goes as
|q diag(s)|^2 |k diag(1/s)|^2, least for s^2 = |k channel| / |q channel| (Cauchy-Schwarz), whose
magnitudes the gains set: s = sqrt(k gain / q gain), each channel's paired with its rotary
partner's (rotary mixes the two). On Gemma 3 270M at 512 tokens the rotation takes KL to 2.1e-4;
on windows without <bos> (a script's two), 1.5e-3 with H alone, 1.1e-3 with s = sqrt(k gain) and
9.0e-4 with the q gains too (docs/performance.md). Values are stored as they are: rotating them
too made it worse.
"""

from __future__ import annotations

import math

import torch

from kvserve.layers.attention.kv_quant import SCHEME

TRANSFORM = "hadamard-qk-gains"


def rotates_keys(qk_norm: bool, head_dim: int) -> bool:
    """Whether a model's int8 keys go rotated: where they pass a k_norm and H exists (a power of two)."""
    return qk_norm and _power_of_two(head_dim)


def int8_scheme(qk_norm: bool, head_dim: int) -> str:
    """What a model's int8 rows hold, for the tier namespace: rotated keys are another scheme's."""
    return f"{SCHEME}+{TRANSFORM}" if rotates_keys(qk_norm, head_dim) else SCHEME


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal (Sylvester) Hadamard matrix of order n, a power of two; symmetric."""
    if not _power_of_two(n):
        raise ValueError(f"a Hadamard rotation needs a head_dim that is a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def key_rotation(
    q_norm_gain: torch.Tensor, k_norm_gain: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q's matrix, k's matrix) for queries and keys that pass these gains: q @ first . k @ second = q . k."""
    s = (_paired(k_norm_gain) / _paired(q_norm_gain)).sqrt()
    h = hadamard(s.shape[0])
    device = k_norm_gain.device
    return (s[:, None] * h).to(device, dtype), (h / s[:, None]).to(device, dtype)


def _paired(gain: torch.Tensor) -> torch.Tensor:
    """Each channel's gain and its rotary partner's (d, d + head_dim / 2), as one RMS."""
    g = gain.detach().float().abs()
    half = g.shape[0] // 2
    paired = ((g[:half] ** 2 + g[half:] ** 2) / 2).sqrt().clamp_min(1e-6)
    return torch.cat([paired, paired])
