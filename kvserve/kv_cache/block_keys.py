"""Chained block keys: SHA-256 over (the parent block's key, the extra key, the block's
token ids as int64), so a key names the whole prefix up to and including its block.

The same prompt under the same extra key gives the same keys in every process and after
a restart (no Python `hash()`, no pickle); the tenant's salt enters only inside the extra
key's digest. The KV cache manager keeps each request's keys (`KVRequest.block_keys`) and
extends them as blocks fill, so each key is computed once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_key(parent: bytes, token_ids: Sequence[int], extra_key: bytes) -> bytes:
    h = hashlib.sha256(parent)
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(parent: bytes, token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[bytes]:
    """The keys of the full blocks of `token_ids`, continuing the chain after `parent`."""
    keys = []
    for i in range(len(token_ids) // block_size):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        keys.append(parent)
    return keys


def extend_keys(
    keys: list[bytes], token_ids: Sequence[int], num_blocks: int, block_size: int, extra_key: bytes
) -> None:
    """Grow `keys` (the chain of `token_ids`' first blocks) to its first `num_blocks` blocks."""
    if len(keys) < num_blocks:
        start = len(keys) * block_size
        parent = keys[-1] if keys else b""
        keys.extend(chain_keys(parent, token_ids[start : num_blocks * block_size], block_size, extra_key))
