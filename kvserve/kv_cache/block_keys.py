"""Chained block keys: SHA-256 over (the parent block's key, the extra key, the block's
token ids as little-endian int64), so a key names the whole prefix up to and including its block.

The same prompt under the same extra key gives the same keys in every process and after
a restart (no Python `hash()`, no pickle); the tenant's salt enters only inside the extra
key's digest. The KV cache manager keeps each request's keys (`KVRequest.block_keys`) and
extends them as blocks fill, so each key is computed once.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def chain_keys_hashlib(parent: bytes, token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[bytes]:
    """The keys of the full blocks of `token_ids`, continuing the chain after `parent`.

    The tokens are packed once (`struct`, little-endian whatever the machine) and hashed
    slice by slice, each block's input in one call. `chain_keys` is the C loop
    (`csrc/block_keys.c`) where it was built: the same keys, ~4x faster, since hashlib's
    set-up per call outweighs hashing a block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    width = block_size * 8
    n = len(token_ids) // block_size * block_size
    packed = struct.pack(f"<{n}q", *token_ids[:n])
    sha256 = hashlib.sha256
    keys = []
    for start in range(0, len(packed), width):
        parent = sha256(parent + extra_key + packed[start : start + width]).digest()
        keys.append(parent)
    return keys


try:
    from kvserve.kv_cache._block_keys import chain_keys

    HASHED_IN = "C"
except ImportError:  # not built (no C compiler or no libcrypto.so.3 at install)
    chain_keys = chain_keys_hashlib
    HASHED_IN = "Python"


def extend_keys(
    keys: list[bytes], token_ids: Sequence[int], num_blocks: int, block_size: int, extra_key: bytes
) -> None:
    """Grow `keys` (the chain of `token_ids`' first blocks) to its first `num_blocks` blocks."""
    if len(keys) < num_blocks:
        start = len(keys) * block_size
        parent = keys[-1] if keys else b""
        keys.extend(chain_keys(parent, token_ids[start : num_blocks * block_size], block_size, extra_key))


def group_key(key: bytes, group: int) -> bytes:
    """The key outside the engine of block `key` in KV group `group` (its layers only): the
    first group's is the chained key itself, so single-group models keep their keys."""
    return key if group == 0 else hashlib.sha256(b"kv-group" + group.to_bytes(2, "little") + key).digest()
