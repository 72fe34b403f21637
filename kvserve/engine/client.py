"""The engine as a server sees it: the one surface the HTTP layer uses (and a router or a
prefill/decode role would), so that none of them reaches into the engine's internals.

`AsyncLLMEngine` implements it over an in-process `LLMEngine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvserve.engine.kv_state import KVState
    from kvserve.engine.stats import EngineStats
    from kvserve.kv_cache.tiers.store import TierSnapshot


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine stopped after an error; no request can run (HTTP 503)."""


@dataclass(frozen=True)
class ModelInfo:
    model: str  # as configured: a short name, a directory or a .gguf file
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class KVEventsInfo:
    endpoint: str  # as bound (a wildcard port resolved); the server makes it connectable
    replay_endpoint: str | None
    topic: str
    token_ids: bool  # whether BlockStored carries token ids (an opt-in)


@dataclass(frozen=True)
class ReplicaInfo:
    """What a router needs to compute this replica's block keys and follow its cache (GET /server_info)."""

    tokenizer_dir: str  # absolute path of the checkpoint directory the tokenizer was loaded from
    block_size: int
    num_kv_blocks: int
    kv_tiers: tuple[str, ...]  # below the device pool, in order: "host", "disk", "redis"
    kv_events: KVEventsInfo | None
    role: str = "both"  # prefill/decode disaggregation: "prefill", "decode" or "both"
    engine_id: str = ""  # names this engine in kv_transfer_params (remote_engine_id)
    kv_record_bytes: int = 0  # one block as the tiers and a handoff carry it
    kv_cache_dtype: str = "float32"  # how K/V are stored: "float32", "bfloat16", "int8"
    kv_bytes_per_token: int = 0  # K and V of every layer, as stored

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is doing now (read without stopping it) and its running totals."""

    num_running: int
    num_waiting: int  # queued, including requests handed over and not yet applied
    kv_cache_usage: float  # fraction of KV blocks in use
    totals: EngineStats
    kv_tiers: list[TierSnapshot] = field(default_factory=list)  # host RAM, disk, Redis: those configured
    block_size: int = 16
    kv_leases: int = 0  # a prefill replica's prompts held for decode replicas
    kv_lease_expiries: int = 0


StepHook = Callable[[list[RequestOutput]], None]  # called in the engine thread after each step


class EngineClient(Protocol):
    model_info: ModelInfo
    replica_info: ReplicaInfo
    on_step: list[StepHook]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; a bad request raises ValueError, a full queue
        QueueFullError, a dead engine EngineDeadError. Closing the iterator early aborts it."""

    async def abort(self, request_id: str) -> None: ...

    async def export_kv(self, owner: str, block_keys: list[bytes], release: bool) -> memoryview:
        """A prefill replica: the records, end to end, of the leading run of `block_keys` that the
        lease of finished request `owner` holds (none for keys it does not hold); `release` drops it."""

    async def flush_kv(self) -> None:
        """Wait until the blocks queued for the slow tiers (Redis) are written."""

    def release_kv(self, owner: str) -> None:
        """A prefill replica: the decode side gave up on request `owner`'s blocks."""

    def import_kv(self, block_keys: list[bytes], records: list[memoryview]) -> int:
        """A decode replica: records pulled from a prefill replica, for the next lookup of their
        prefix; returns how many, from the first, were sound."""

    def load(self) -> EngineLoad: ...

    def unfinished_request_ids(self) -> Collection[str]:
        """Requests not finished yet (safe to call from a step hook)."""

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (nothing dropped) while requests run."""

    async def kv_state(self) -> KVState:
        """A snapshot of the KV pool, the prefix cache, the tiers and the queues (GET /debug/kv_state),
        taken by the engine without stalling its step loop."""

    def check_health(self) -> None:
        """Raises EngineDeadError once the engine has stopped after an error."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...
