"""KV event batches on the wire, byte for byte as vLLM puts them (`vllm.distributed.kv_events`).

vLLM encodes with msgspec; this writes the same msgpack with the plain `msgpack` package:

- a batch is `EventBatch(array_like=True, omit_defaults=True)`: the array
  `[ts, events, data_parallel_rank]` (float64 seconds since the epoch, a list, an int);
- an event is `KVCacheEvent(tag=True, omit_defaults=True)`, no longer `array_like` since
  vLLM #42892: a map whose first key is `"type"` (the class name), then the fields in
  declaration order, leaving out those that carry a default and hold it (kvserve sets none
  of them). Older vLLM sent each event as an array `[tag, field, ...]`; `encoding="array"`
  writes that, through `lora_name`, for consumers that predate the change (msgspec ignores
  trailing fields it does not know, and the optional ones are all trailing), and
  `decode_batch` reads both.

A block hash is kvserve's chained block key: 32 bytes (msgpack bin), which vLLM's
`ExternalBlockHash = bytes | int` allows. The tenant salt is inside it as a digest, and
no field here carries the salt itself (vLLM's `extra_keys` would: it is never sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

ENCODINGS = ("map", "array")

# Each event's fields in vLLM's declaration order: the required ones. Those with a default
# (extra_keys, group_idx, ...) come after them, and a map leaves them out while they hold it.
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
REMOVED_FIELDS = ("block_hashes", "medium")


@dataclass(frozen=True)
class DecodedBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None
    skipped: int = 0  # events of a kind this decoder does not know (a newer publisher's)


def event_fields(event: KVCacheEvent) -> tuple[str, dict[str, Any]]:
    """The event's tag and its wire fields, in vLLM's order (`lora_name`: kvserve has no adapters)."""
    if isinstance(event, BlockStored):
        values = (
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            None,
        )
        return "BlockStored", dict(zip(STORED_FIELDS, values, strict=True))
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", {"block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", {}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_event(event: KVCacheEvent, encoding: str = "map") -> dict[str, Any] | list[Any]:
    tag, fields = event_fields(event)
    if encoding == "array":
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0, encoding: str = "map") -> bytes:
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
    body = [float(ts), [encode_event(e, encoding) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> DecodedBatch:
    """A batch from vLLM or kvserve, events as maps or arrays; raises ValueError if malformed."""
    try:
        body = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises several kinds for bad input
        raise ValueError(f"not a msgpack KV event batch: {e}") from e
    if not isinstance(body, list) or len(body) not in (2, 3) or not isinstance(body[1], list):
        raise ValueError("a KV event batch is the array [ts, events, data_parallel_rank]")
    events, skipped = [], 0
    for raw in body[1]:
        try:
            event = decode_event(raw)
        except (KeyError, TypeError) as e:  # a field missing or of the wrong kind
            raise ValueError(f"malformed KV event: {e!r}") from e
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return DecodedBatch(float(body[0]), events, body[2] if len(body) == 3 else None, skipped)


def decode_event(raw: Any) -> KVCacheEvent | None:
    """One event, tagged map or tagged array; None for a tag this decoder does not know."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise ValueError(f"a KV event is a tagged map or array, got {type(raw).__name__}")
    if tag == "BlockStored":
        return BlockStored(
            list(fields["block_hashes"]),
            fields.get("parent_block_hash"),
            list(fields.get("token_ids") or []),
            int(fields["block_size"]),
            fields.get("lora_id"),
            fields.get("medium"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(list(fields["block_hashes"]), fields.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
