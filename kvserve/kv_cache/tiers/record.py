"""One stored block as a self-describing, checked record (disk files and Redis values).

    magic "KVSV" | format version u16 | dtype code u8 | ndim u8 | namespace digest (32)
    | tier key (32) | shape (ndim x u32) | payload length u64 | XXH3-64 of the payload u64
    | payload

Reading checks every field against what the reader expects; any difference is a
`BadRecord`, which the tiers count and treat as a miss. XXH3-64 catches torn writes and
flipped bits at memory speed (zlib's CRC-32 ran at ~1 GB/s and took most of a disk read);
the records are not a defence against an attacker who can write to the tier (who could
as well write a valid record).
"""

from __future__ import annotations

import struct

import xxhash

from kvserve.kv_cache.tiers.namespace import FORMAT_VERSION, Namespace

MAGIC = b"KVSV"
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "int8": 4}  # int8: uint8 codes with their scales
_HEAD = struct.Struct("<4sHBB32s32s")
_TAIL = struct.Struct("<QQ")


class BadRecord(ValueError):
    """A record that does not hold what the reader asked for; the reason names the field."""


def header(ns: Namespace, key: bytes, payload: bytes | memoryview) -> bytes:
    shape = ns.block_shape
    return b"".join(
        (
            _HEAD.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[ns.kv_dtype], len(shape), ns.digest, key),
            struct.pack(f"<{len(shape)}I", *shape),
            _TAIL.pack(len(payload), xxhash.xxh3_64_intdigest(payload)),
        )
    )


def encode(ns: Namespace, key: bytes, payload: bytes | memoryview) -> bytes:
    return header(ns, key, payload) + payload


def header_size(ns: Namespace) -> int:
    return _HEAD.size + 4 * len(ns.block_shape) + _TAIL.size


def decode(ns: Namespace, key: bytes, data: bytes | memoryview) -> memoryview:
    """The payload of `data`, checked to be block `key` of namespace `ns`; else BadRecord."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise BadRecord(f"truncated: {len(view)} bytes")
    magic, version, dtype, ndim, digest, stored_key = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise BadRecord("magic")
    if version != FORMAT_VERSION:
        raise BadRecord(f"format version {version}, expected {FORMAT_VERSION}")
    if digest != ns.digest:
        raise BadRecord("namespace (another model, dtype, block size or layout)")
    if stored_key != key:
        raise BadRecord("key")
    if dtype != DTYPE_CODES[ns.kv_dtype]:
        raise BadRecord(f"dtype code {dtype}")
    if ndim != len(ns.block_shape) or len(view) < header_size(ns):
        raise BadRecord("shape")
    shape = struct.unpack_from(f"<{ndim}I", view, _HEAD.size)
    if tuple(shape) != tuple(ns.block_shape):
        raise BadRecord(f"shape {shape}")
    length, checksum = _TAIL.unpack_from(view, _HEAD.size + 4 * ndim)
    payload = view[header_size(ns) :]
    if length != ns.block_nbytes or len(payload) != length:
        raise BadRecord(f"length {len(payload)}, header says {length}, expected {ns.block_nbytes}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise BadRecord("checksum")
    return payload
