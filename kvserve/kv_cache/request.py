"""What the KV cache needs of a request: a protocol, so this package needs no engine (and no torch)."""

from __future__ import annotations

from typing import Protocol


class KVRequest(Protocol):
    """`kvserve.engine.request.Request` is one; tests use small stand-ins."""

    @property
    def seq_id(self) -> int:
        """Unique per sample: what block tables are keyed by."""

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the pool (cached or computed)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def extra_key(self) -> bytes:
        """What partitions the prefix cache besides tokens: digest of tenant salt, adapter."""

    # the chained keys of the request's first full blocks (`block_keys`), which the manager
    # extends as blocks fill; a fork starts with a copy of its parent's
    block_keys: list[bytes]
