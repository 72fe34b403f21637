"""The engine for a server: its step loop runs in its own thread, off the event loop.

Only the engine thread touches `LLMEngine`. Coroutines hand it requests and
aborts through a command queue and receive `RequestOutput`s through one
asyncio queue per request, so HTTP stays responsive while the model computes
(torch releases the GIL in its kernels). Prompts are tokenized by the caller, in
a worker thread, so a huge prompt never stalls the loop or the engine.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.client import (
    EngineDeadError,
    EngineLoad,
    KVEventsInfo,
    ModelInfo,
    QueueFullError,
    ReplicaInfo,
    StepHook,
)
from kvserve.engine.kv_state import KVState, KVStateFeed
from kvserve.engine.llm_engine import LLMEngine, StepFailedError
from kvserve.kv_cache.tiers.namespace import tier_key
from kvserve.kv_cache.tiers.record import BadRecord, decode, header_size
from kvserve.logger import logger
from kvserve.outputs import RequestOutput
from kvserve.platforms import kv_dtype_name
from kvserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ReleaseKV:
    owner: str


@dataclass
class _ResetPrefixCache:
    done: asyncio.Future[bool]


@dataclass
class _CaptureKVState:
    done: asyncio.Future[KVState]


_Command = _Add | _Abort | _ReleaseKV | _ResetPrefixCache | _CaptureKVState
LEASE_CHECK_SECONDS = 0.5  # how late an expired lease may be freed while the engine is idle


class AsyncLLMEngine:
    """`EngineClient` over an `LLMEngine` stepped in a thread of its own."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None):
        self.engine = engine
        self.model_info = ModelInfo(
            engine.config.model, engine.scheduler.config.max_model_len, engine.model_config.vocab_size
        )
        self.replica_info = replica_info(engine)
        self.max_queued_requests = max_queued_requests
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._adds_sent = self._adds_applied = 0  # each written by one thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.kv_feed = KVStateFeed(engine, self.num_waiting)
        self.on_step: list[StepHook] = [self.kv_feed.after_step]  # and metrics hooks; engine thread
        self.errored: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, max_queued_requests: int | None = None) -> AsyncLLMEngine:
        return cls(_build_off_main_thread(config), max_queued_requests)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; raises the engine's ValueError for a bad request.

        Cancelling the consumer (a client that disconnected) aborts the request and
        frees its blocks at once.
        """
        self.check_health()
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise QueueFullError(f"{self.num_waiting()} requests are already queued")
        if isinstance(prompt, str):  # tokenize here, not in the engine thread
            prompt = await asyncio.to_thread(self.engine.tokenizer.encode, prompt)  # as LLMEngine does
        add = _Add(request_id, prompt, params, cache_salt, asyncio.Queue())
        self._adds_sent += 1
        self._commands.put(add)
        finished = False
        try:
            while not finished:
                item = await add.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def num_waiting(self) -> int:
        """Queued in the scheduler, plus handed over but not yet applied."""
        return self.engine.scheduler.num_waiting + self._adds_sent - self._adds_applied

    def load(self) -> EngineLoad:
        core = self.engine
        tiers = core.store.snapshot() if core.store is not None else []
        return EngineLoad(
            len(core.scheduler.running),
            self.num_waiting(),
            core.kv.pool.usage(),
            core.stats,
            tiers,
            core.kv.block_size,
            len(core.kv.leases),
            core.kv.num_expired_leases,
        )

    def unfinished_request_ids(self) -> Collection[str]:
        return self.engine.output_processor.groups.keys()

    async def export_kv(self, owner: str, block_keys: list[bytes], release: bool) -> memoryview:
        """The records of the blocks lease `owner` holds under these keys, read on a worker thread
        while the steps go on (a prefill step on a busy replica takes up to a second)."""
        self.check_health()
        body = await asyncio.to_thread(self.engine.export_kv, owner, block_keys)
        if release:
            self.release_kv(owner)
        return body

    async def flush_kv(self) -> None:
        if self.engine.store is not None:
            await asyncio.to_thread(self.engine.store.flush)

    def release_kv(self, owner: str) -> None:
        self._commands.put(_ReleaseKV(owner))

    def import_kv(self, block_keys: list[bytes], records: list[memoryview]) -> int:
        """Blocks pulled from a prefill replica, checked, for this replica's next lookup of their
        prefix; returns how many of them, from the first, were sound (thread-safe)."""
        store, ns = self.engine.store, self.engine.namespace
        if store is None:
            return 0
        payloads = []
        for key, data in zip(block_keys, records, strict=False):
            try:
                payloads.append(decode(ns, tier_key(ns.digest, key), data))
            except BadRecord as e:
                logger.warning("a pulled KV block is bad (%s): the rest is computed", e)
                break
        store.put_handoff(block_keys[: len(payloads)], payloads)
        return len(payloads)

    async def reset_prefix_cache(self) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._commands.put(_ResetPrefixCache(done))
        return await done

    async def kv_state(self) -> KVState:
        """A snapshot of the KV cache and queues; never stalls the step loop (see engine/kv_state.py)."""
        self.check_health()
        state = self.kv_feed.current()
        if state is None:  # changed since the last one: the engine thread takes one between steps
            done: asyncio.Future[KVState] = asyncio.get_running_loop().create_future()
            self._commands.put(_CaptureKVState(done))
            try:
                state = await asyncio.wait_for(done, timeout=2.0)
            except TimeoutError:  # a long step, or a stuck engine: the last one, dated by its `taken`
                if self.kv_feed.latest is None:
                    raise
                state = self.kv_feed.latest
        return state

    def check_health(self) -> None:
        if self.errored is not None:
            raise EngineDeadError("the engine has stopped after an error") from self.errored

    def _run(self) -> None:
        try:
            while True:
                self.engine.expire_kv_leases()
                block = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    self.engine.shutdown()  # in this thread: the engine's state is this thread's
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # not a failed step (those end their own requests): fail every stream
            logger.exception("engine loop crashed")
            self.errored = e
            for add in list(self._streams.values()):
                self._deliver(add, e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailedError as e:  # those requests are gone from the engine: end their streams
            for request_id in e.request_ids:
                if (add := self._streams.pop(request_id, None)) is not None:
                    self._deliver(add, e)
            outputs = []
        self._publish(outputs)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts (waiting for one when idle); False on shutdown."""
        while True:
            try:  # idle with leases held: wake up to expire them
                cmd = self._commands.get(block=block, timeout=LEASE_CHECK_SECONDS if self.engine.kv.leases else None)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Abort):
                self._streams.pop(cmd.request_id, None)
                self.engine.abort_request(cmd.request_id)
                continue
            if isinstance(cmd, _ResetPrefixCache):
                assert self._loop is not None
                self._loop.call_soon_threadsafe(cmd.done.set_result, self.engine.reset_prefix_cache())
                continue
            if isinstance(cmd, _ReleaseKV):
                self.engine.release_kv(cmd.owner)
                continue
            if isinstance(cmd, _CaptureKVState):
                self._deliver_state(cmd.done, self.kv_feed.capture())
                continue
            self._adds_applied += 1
            try:
                self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, cache_salt=cmd.cache_salt)
                self._streams[cmd.request_id] = cmd
            except ValueError as e:
                self._deliver(cmd, e)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        deliveries: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]] = []
        for out in outputs:
            add = self._streams.get(out.request_id)
            if add is not None:
                deliveries.append((add.outputs, out))
                if out.finished:
                    del self._streams[out.request_id]
        if deliveries:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_put_all, deliveries)
        for hook in self.on_step:
            hook(outputs)

    def _deliver_state(self, done: asyncio.Future[KVState], state: KVState) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: done.done() or done.set_result(state))  # its reader may be gone

    def _deliver(self, add: _Add, item: RequestOutput | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(add.outputs.put_nowait, item)


def replica_info(engine: LLMEngine) -> ReplicaInfo:
    cfg, pub = engine.config, engine.kv_events
    events = None
    if pub is not None:
        events = KVEventsInfo(pub.endpoint, pub.replay_endpoint, pub.topic, cfg.kv_events_token_ids)
    tiers = tuple(t.name for t in engine.store.tiers if t.name != "handoff") if engine.store is not None else ()
    ns = engine.namespace
    kv_dtype = kv_dtype_name(engine.kv_dtype)
    return ReplicaInfo(
        str(engine.model_dir),
        engine.kv.block_size,
        engine.kv.pool.num_blocks,
        tiers,
        events,
        cfg.role,
        uuid.uuid4().hex,
        header_size(ns) + ns.block_nbytes,
        kv_dtype,
        engine.kv_bytes_per_token,
    )


def _put_all(deliveries: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for outputs, out in deliveries:
        outputs.put_nowait(out)


def _build_off_main_thread(config: EngineConfig) -> LLMEngine:
    """Load the model in a short-lived thread, so the main thread never runs torch's OpenMP work.

    The first thread to run an OpenMP parallel region owns a thread team for the life of the
    process; the engine thread then gets a second team, and the two contend for the cores:
    measured on 2 cores, a batch-1 decode step took 36 ms instead of 24 ms. A team whose
    thread has exited is gone, so building here leaves the engine thread the only team.
    """
    built: list[LLMEngine | BaseException] = []

    def build() -> None:
        try:
            built.append(LLMEngine(config))
        except BaseException as e:  # re-raised on the caller's thread
            built.append(e)

    thread = threading.Thread(target=build, name="kvserve-load")
    thread.start()
    thread.join()
    if isinstance(built[0], BaseException):
        raise built[0]
    return built[0]
