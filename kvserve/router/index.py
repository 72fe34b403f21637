"""Which blocks each replica holds: from its KV events, or, without them, from what the router sent it.

Both are keyed by chained block keys, computed with the tenant's salt inside the extra key
(`block_keys.chain_keys`), so a tenant's keys never equal another tenant's: no lookup can
score a request against someone else's blocks. The router holds digests only, no tokens.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvserve.kv_cache.events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(frozen=True)
class CachedRun:
    """The blocks a replica would find for a prompt: a run in its device pool, then one in its tiers."""

    device_blocks: int = 0
    tier_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.tier_blocks


def usable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a replica may take from its cache: the last prompt token is always computed (its logits)."""
    return max(0, (num_tokens - 1) // block_size)


def _run(keys: Sequence[bytes], start: int, held: Container[bytes]) -> int:
    """How many of `keys`, from `start` on, are held before the first that is not."""
    n = 0
    for key in itertools.islice(keys, start, None):
        if key not in held:
            break
        n += 1
    return n


class BlockIndex:
    """A replica's blocks by medium ("GPU": its device pool; "CPU", "DISK": its tiers), fed by its events.

    Events arrive on the subscriber's thread and lookups come from the event loop: a lock
    guards the sets (each operation is short).
    """

    def __init__(self) -> None:
        self._device: set[bytes] = set()
        self._tiers: dict[bytes, set[str]] = {}
        self._lock = threading.Lock()
        self._last_seq = -1

    def on_batch(self, seq: int, ts: float, events: list[KVCacheEvent]) -> None:
        """The subscriber's callback, in sequence order; a number going back: the replica restarted empty."""
        if seq <= self._last_seq:
            self.clear()
        self._last_seq = seq
        self.apply(events)

    def apply(self, events: Sequence[KVCacheEvent]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    for key in event.block_hashes:
                        self._store(key, event.medium or DEVICE)
                elif isinstance(event, BlockRemoved):
                    for key in event.block_hashes:
                        self._remove(key, event.medium or DEVICE)
                elif isinstance(event, AllBlocksCleared):
                    self._device.clear()  # the pool was reset; the tiers below it keep their blocks

    def _store(self, key: bytes, medium: str) -> None:
        if medium == DEVICE:
            self._device.add(key)
        else:
            self._tiers.setdefault(key, set()).add(medium)

    def _remove(self, key: bytes, medium: str) -> None:
        if medium == DEVICE:
            self._device.discard(key)
        elif (media := self._tiers.get(key)) is not None:
            media.discard(medium)
            if not media:
                del self._tiers[key]

    def cached_run(self, keys: Sequence[bytes]) -> CachedRun:
        """As the replica matches: the longest prefix in the pool, then the blocks after it found in a tier."""
        with self._lock:
            device = _run(keys, 0, self._device)
            tier = _run(keys, device, self._tiers)
        return CachedRun(device, tier)

    def clear(self) -> None:
        with self._lock:
            self._device.clear()
            self._tiers.clear()

    def sizes(self) -> dict[str, int]:
        with self._lock:
            sizes = {DEVICE: len(self._device)}
            for media in self._tiers.values():
                for m in media:
                    sizes[m] = sizes.get(m, 0) + 1
        return sizes


class SentBlocks:
    """The fallback for a replica without (fresh) events: the prompt blocks the router sent it.

    An LRU of chained keys, the tree of every tenant's prompts (each tenant's chains start
    from its own salted root), bounded by the replica's real KV capacity. A prompt's keys
    are touched last block first, so a parent is always fresher than its children and
    eviction cuts a chain from its tail, as the replica's own cache does.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def record(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)

    def cached_run(self, keys: Sequence[bytes]) -> CachedRun:
        return CachedRun(_run(keys, 0, self._keys), 0)

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
