"""Blocks a decode replica pulled from a prefill replica, waiting for their request's lookup.

Kept as host RAM keeps blocks (an LRU of payloads, bounded in bytes; here views of the
pull's one body, which lives until its last block is taken), but outside the
tier hierarchy: nothing is written back into it, and the lookup that finds a block takes
it out, since from then on the block is in the device pool and its prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv_cache.tiers.host import HostTier


class HandoffTier(HostTier):
    name = "handoff"

    def _own(self, view: memoryview) -> memoryview:
        # a view of the pulled body, kept as it is: nothing else writes to it
        return view

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        out = super().get(keys)
        with self._lock:
            for key, payload in zip(keys, out, strict=True):
                if payload is not None and self._entries.pop(key, None) is not None:
                    self._used -= len(payload)
        return out
