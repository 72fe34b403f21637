"""What a stored block's K/V depend on besides its tokens: the namespace of a tier key.

Two engines share stored blocks only if they agree on the model's weights (and the dtype
they were rounded to), the KV dtype (and int8's quantization scheme), the block size and the
KV layout, and on kvserve's record format. Each of these enters the namespace digest, and the
digest enters every tier key and record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

FORMAT_VERSION = 2  # the record format (record.py); bump on any change to it
KV_LAYOUT_VERSION = 1  # one block = [layers, 2 (K, V), block_size, kv_heads, head_dim], contiguous


@dataclass(frozen=True)
class Namespace:
    model_fingerprint: str  # digest of the weights files' contents
    kv_dtype: str  # "float32", "bfloat16", "int8" (uint8 rows: codes, then scale and minimum)
    block_size: int
    block_shape: tuple[int, ...]  # one block's payload: (layers, 2, block_size, kv_heads, head_dim (int8: + 8))
    weight_dtype: str | None = None  # what the weights were rounded to, if narrower than kv_dtype
    compute_dtype: str | None = None  # what K/V were computed in, if not kv_dtype
    kv_quant: str | None = None  # int8's quantization scheme (layers/attention/kv_quant.SCHEME)
    kv_layout_version: int = KV_LAYOUT_VERSION
    format_version: int = FORMAT_VERSION

    @cached_property
    def digest(self) -> bytes:
        fields = asdict(self)
        for name in ("compute_dtype", "kv_quant"):
            if fields[name] is None:  # left out: records of before the field keep their keys
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[self.kv_dtype]

    @property
    def block_nbytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n


def tier_key(namespace_digest: bytes, block_key: bytes) -> bytes:
    """The key a block is stored under in every tier: neither the salt nor a token id is
    recoverable from it (block keys are already digests)."""
    return hashlib.sha256(namespace_digest + block_key).digest()
