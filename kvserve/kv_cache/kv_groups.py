"""KV cache groups: layers of one attention kind share block tables (vLLM's hybrid KV cache).

A model whose layers all attend to the whole context (Llama) has one group: a block holds
`block_size` tokens of every layer, as it always did. A model with sliding-window layers
(Gemma 3: a 512-token window on 5 of every 6 layers) keeps those layers apart, because
their blocks can go back to the pool once the window has passed them, while the full
layers' blocks stay for the whole request.

All groups draw from one `BlockPool`, so blocks must be the same size in every group:
layers are split into groups of `group_size` layers (the fewest layers of any kind), and
a block holds `block_size` tokens of `group_size` layers. Gemma 3 270M (15 window layers,
3 full): one full group and five window groups of three layers each; the KV memory is
three tensors (`num_slots`), and the i-th layer of every group lives in tensor i, at the
rows of the blocks its group's tables name. Each request has one block table per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a query at `position` (and every later one) can see: blocks
        before it hold only keys at least `sliding_window` positions back."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one request of `num_tokens` tokens holds in this group, at most, between steps."""
        blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, -(-self.sliding_window // block_size) + 1)


@dataclass(frozen=True)
class KVCacheConfig:
    groups: tuple[KVCacheGroupSpec, ...]  # full-attention groups first

    def __post_init__(self) -> None:
        if not self.groups or self.groups[0].sliding_window is not None:
            raise ValueError("a model needs at least one full-attention layer (window-only models are not supported)")

    @classmethod
    def single(cls, num_layers: int) -> KVCacheConfig:
        return cls((KVCacheGroupSpec(tuple(range(num_layers))),))

    @classmethod
    def from_layer_windows(cls, windows: Sequence[int | None]) -> KVCacheConfig:
        """Groups of the fewest layers of any kind, full ones first, each in layer order."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))
        groups = [
            KVCacheGroupSpec(tuple(kinds[w][i : i + size]), w) for w in order for i in range(0, len(kinds[w]), size)
        ]
        return cls(tuple(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """KV tensors: a block holds this many layers (its group's, one per tensor)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group, tensor) of every layer, in layer order."""
        where = {layer: (g, slot) for g, spec in enumerate(self.groups) for slot, layer in enumerate(spec.layers)}
        return [where[layer] for layer in range(self.num_layers)]

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks one request of `num_tokens` tokens holds in all groups together, at most, between steps."""
        return sum(g.max_blocks(num_tokens, block_size) for g in self.groups)

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest request a pool of `num_blocks` can hold alone: window groups take
        their window's blocks, the full groups share the rest."""
        full = [g for g in self.groups if g.sliding_window is None]
        windows = sum(-(-g.sliding_window // block_size) + 1 for g in self.groups if g.sliding_window is not None)
        if len(full) == len(self.groups):
            return num_blocks // len(full) * block_size
        return max(0, num_blocks - windows) // len(full) * block_size

    def describe(self) -> str:
        full = sum(1 for g in self.groups if g.sliding_window is None)
        windows = sorted({g.sliding_window for g in self.groups if g.sliding_window is not None})
        text = f"{self.num_groups} KV groups of {self.num_slots} layers: {full} full"
        return text + "".join(f", {self.num_groups - full} sliding window {w}" for w in windows)

    def read_bytes(self, context_len: int, layer_bytes_per_token: int) -> int:
        """K/V one decode query at `context_len` attends over, every layer: a window layer reads its window."""
        seen = [len(g.layers) * min(context_len, g.sliding_window or context_len) for g in self.groups]
        return sum(seen) * layer_bytes_per_token

    def block_bytes(self, layer_bytes_per_token: int, block_size: int) -> int:
        """A block: `block_size` tokens of `num_slots` layers."""
        return self.num_slots * layer_bytes_per_token * block_size

    def request_bytes(self, num_tokens: int, layer_bytes_per_token: int, block_size: int) -> int:
        """KV memory one request of `num_tokens` tokens holds at most, between steps."""
        return self.max_blocks(num_tokens, block_size) * self.block_bytes(layer_bytes_per_token, block_size)

    def sizing(self, layer_bytes_per_token: int, block_size: int) -> str:
        """The start-up line's formula: bytes per token of the full layers, per window of the others."""
        full = sum(len(g.layers) for g in self.groups if g.sliding_window is None) * layer_bytes_per_token
        text = f"{self.describe()}; a request holds {full} bytes/token of full layers"
        for w in sorted({g.sliding_window for g in self.groups if g.sliding_window is not None}):
            layers = sum(len(g.layers) for g in self.groups if g.sliding_window == w)
            window_bytes = layers * layer_bytes_per_token * (-(-w // block_size) + 1) * block_size
            text += f" + at most {window_bytes} bytes per {w}-token window"
        return text
