"""The engine: requests in, one scheduler step -> one forward -> outputs, repeat."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import torch

from kvserve.config import EngineConfig, parse_memory
from kvserve.engine.beam_group import BEAM_SAMPLING_PARAMS, BeamGroup
from kvserve.engine.kv_transfer import KVTransfer, block_shape
from kvserve.engine.model_runner import (
    ModelRunner,
    allocate_kv_caches,
    kv_bytes_per_token,
    kv_cache_config,
    kv_slots,
)
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.ranges import named_range
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.stats import EngineStats
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, make_prefix_cache
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers.disk import DiskTier
from kvserve.kv_cache.tiers.handoff import HandoffTier
from kvserve.kv_cache.tiers.host import HostTier
from kvserve.kv_cache.tiers.namespace import Namespace, tier_key
from kvserve.kv_cache.tiers.pages import BufferPool
from kvserve.kv_cache.tiers.record import header, header_size
from kvserve.kv_cache.tiers.remote import remote_tier
from kvserve.kv_cache.tiers.store import EventSink, TieredKVStore
from kvserve.kv_events.publisher import ZmqEventPublisher, default_replay_endpoint
from kvserve.layers.attention.key_rotation import int8_scheme
from kvserve.layers.sampler import Sampler
from kvserve.logger import logger
from kvserve.models.fingerprint import model_fingerprint
from kvserve.models.loader import load_config, load_model, resolve_model
from kvserve.outputs import RequestOutput
from kvserve.platforms import get_platform, kv_dtype_name
from kvserve.sampling_params import BeamSearchParams, SamplingParams
from kvserve.tokenizer import load_tokenizer


class StepFailedError(RuntimeError):
    """A step raised: its requests failed (HTTP 500) and were freed; the engine serves the rest."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine failed in a step of {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids


def check_invariants_enabled() -> bool:
    """KVSERVE_CHECK_INVARIANTS=1 (the test suite sets it): check the KV cache's integrity
    whenever the engine goes idle."""
    return os.environ.get("KVSERVE_CHECK_INVARIANTS") == "1"


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = resolve_model(config.model)
        self.model_dir = model_dir.resolve()  # where the tokenizer came from (a router loads the same one)
        self.model_config = load_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        platform = get_platform(config.device, config.dtype, config.kv_cache_dtype)
        self.device, self.dtype, self.weight_dtype = platform.device, platform.dtype, platform.weight_dtype
        self.kv_dtype = platform.kv_dtype
        model = load_model(model_dir, self.model_config, platform)
        self.kv_config = kv_cache_config(model, sliding_window_release=not config.disable_hybrid_kv_cache_manager)
        num_blocks = self._num_blocks()
        kv_caches = allocate_kv_caches(model, num_blocks, config.block_size, self.kv_dtype, self.device, self.kv_config)
        slots = kv_slots(kv_caches)  # each tensor once: what a stored block holds
        cache_kind = config.prefix_cache if config.enable_prefix_caching else None
        self.kv_events = make_kv_event_publisher(config)
        sink = self.kv_events.publish if self.kv_events is not None else None
        scheme = int8_scheme(self.model_config.qk_norm, self.model_config.head_dim)
        self.namespace = kv_namespace(
            model_dir, slots, self.weight_dtype, config.block_size, self.dtype, quant_scheme=scheme
        )
        handoff = num_blocks * self.namespace.block_nbytes if config.role == "decode" else 0
        try:
            self.store = (
                make_kv_store(config, self.namespace, self.device.type != "cpu", sink, handoff)
                if cache_kind is not None
                else None
            )
        except BaseException:
            if self.kv_events is not None:  # its sockets hold the ports
                self.kv_events.close()
            raise
        prefix_cache = make_prefix_cache(cache_kind, config.block_size)
        events = None if self.kv_events is None else "tokens" if config.kv_events_token_ids else "hashes"
        self.kv = KVCacheManager(
            num_blocks, config.block_size, prefix_cache, self.store, events=events, kv_config=self.kv_config
        )
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len, config.prefill_first),
            self.kv,
        )
        copier = platform.block_copy()
        self.transfer = KVTransfer(slots, self.store, copier) if self.store else None
        self.runner = ModelRunner(model, kv_caches, self.kv, Sampler(config.seed), self.transfer, copier)
        self.exporter = KVTransfer(slots, None, copier)  # reads leased blocks out for a decode replica
        self._export_bodies = BufferPool()  # each pull's body, reused once the server has sent it
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.eos_token_ids = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.check_invariants = check_invariants_enabled()
        self._step_out: SchedulerOutput | None = None  # the running step's, for _fail_step

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, as stored (int8: scales included)."""
        return kv_bytes_per_token(self.model_config, self.kv_dtype)

    @property
    def kv_layer_bytes_per_token(self) -> int:
        """K and V of one layer for one token, as stored: what the KV groups size blocks by."""
        return self.kv_bytes_per_token // self.model_config.num_hidden_layers

    def _num_blocks(self) -> int:
        cfg = self.config
        per_layer = self.kv_layer_bytes_per_token
        block_bytes = self.kv_config.block_bytes(per_layer, cfg.block_size)
        num_blocks = cfg.num_kv_blocks or parse_memory(cfg.kv_cache_memory) // block_bytes
        if self.kv_config.num_groups > 1:
            logger.info("KV cache: %s", self.kv_config.sizing(per_layer, cfg.block_size))
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds no block of {cfg.block_size} tokens")
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %d bytes/token (KV dtype %s, %s; compute %s, weights %s)",
            num_blocks,
            cfg.block_size,
            num_blocks * cfg.block_size,
            self.kv_bytes_per_token,
            kv_dtype_name(self.kv_dtype),
            self.device,
            str(self.dtype).removeprefix("torch."),
            str(self.weight_dtype).removeprefix("torch."),
        )
        return num_blocks

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (naming the problem) if it could never run.

        Requests with different `cache_salt` never share cached prefixes (the server
        derives it from the caller's API key).
        """
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise TypeError(f"sampling_params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        beam = params if isinstance(params, BeamSearchParams) else None
        sp = BEAM_SAMPLING_PARAMS if beam else params
        request = Request(
            request_id, prompt_ids, sp, eos_token_ids=tuple(self.eos_token_ids), extra_key=extra_key(cache_salt)
        )
        request.kv_lease = self._kv_lease(sp, beam)
        if beam is not None:  # one request, the prompt, until its first step forks the beams
            request.beam = BeamGroup(request, beam, request.eos_token_ids, self.scheduler.max_total_tokens)
        self.scheduler.add_request(request)
        self.output_processor.add_group(request, prompt if isinstance(prompt, str) else None)
        return request_id

    def _kv_lease(self, params: SamplingParams, beam: BeamSearchParams | None) -> float:
        """Seconds to hold the prompt's blocks for a decode replica: kv_transfer_params
        do_remote_decode (vLLM's), on a replica that prefills for others."""
        transfer = (params.extra_args or {}).get("kv_transfer_params") or {}
        if not transfer.get("do_remote_decode"):
            return 0.0
        if self.config.role == "decode":
            raise ValueError("kv_transfer_params.do_remote_decode: this replica's role is decode, not prefill")
        if beam is not None or params.n != 1:
            raise ValueError("kv_transfer_params.do_remote_decode needs n=1 and no beam search")
        return self.config.kv_lease_seconds

    def export_kv(self, owner: str, block_keys: list[bytes]) -> memoryview:
        """The records (as the tiers store them), end to end in one buffer, of the leading run of
        `block_keys` that lease `owner` holds. Thread-safe, and meant for another thread than the
        steps': held blocks are never written, and the lease is kept while they are read. The
        blocks are gathered straight into the buffer: one copy out of the pool."""
        ids = self.kv.begin_read(owner, block_keys, self.config.kv_lease_seconds)
        if not ids:
            return memoryview(b"")
        try:
            ns = self.namespace
            head, size = header_size(ns), header_size(ns) + ns.block_nbytes
            body = self._export_bodies.take(len(ids) * size)
            payloads = [body[i * size + head : (i + 1) * size] for i in range(len(ids))]
            self.exporter.read_into(ids, payloads)
        finally:
            self.kv.end_read(owner)
        for i, (key, payload) in enumerate(zip(block_keys, payloads, strict=False)):
            body[i * size : i * size + head] = header(ns, tier_key(ns.digest, key), payload)
        return body

    def release_kv(self, owner: str) -> bool:
        released = self.kv.release(owner)
        if released:
            self._check_if_idle()
        return released

    def expire_kv_leases(self) -> None:
        if self.kv.leases and self.kv.expire_leases(time.monotonic()):
            self._check_if_idle()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)  # with its special tokens (Gemma's <bos>), as vLLM's LLM
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)

    def abort_request(self, request_id: str) -> None:
        if self._end_group(request_id, RequestStatus.FINISHED_ABORTED):
            self._publish_kv_events()
            self._check_if_idle()

    def _end_group(self, request_id: str, status: RequestStatus) -> bool:
        """Finish every request of a group now and free its blocks; False if it is not here."""
        group = self.output_processor.drop(request_id)
        if group is None:
            return False
        self.stats.finished_requests[status.value] += 1
        pending = [r for r in [*self.scheduler.waiting, *self.scheduler.loading] if r.group_id == request_id]
        samples = [s.request for s in group.samples.values()]
        running = [r for r in self.scheduler.running if r.group_id == request_id]
        self.scheduler.finish_requests(dict.fromkeys(pending + samples + running), status)
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix. Refused (returns False) while requests run, as in vLLM."""
        if self.has_unfinished_requests():
            return False
        done = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        if done and self.store is not None:
            self.store.announce_held()  # consumers forget every medium on AllBlocksCleared; the tiers kept theirs
        return done

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step; if it raises, its requests fail (StepFailedError names them) and the rest go on."""
        self._step_out = None
        try:
            return self._step()
        except Exception as e:
            raise StepFailedError(self._fail_step(e), e) from e

    def _fail_step(self, cause: Exception) -> list[str]:
        """End the groups the failed step computed (every unfinished one if scheduling itself
        raised), drop what it queued for their blocks, and check that nothing leaked; a KV
        cache that does not check out stops the engine (the caller gets the integrity error)."""
        logger.error("a step failed; its requests fail, the engine goes on", exc_info=cause)
        out = self._step_out
        if out is None:
            ids = list(self.output_processor.groups)
        else:
            requests = [s.request for s in out.scheduled] + [child for _, child in out.forks]
            ids = list(dict.fromkeys(r.group_id for r in requests))
        for request_id in ids:
            self._end_group(request_id, RequestStatus.FINISHED_ERROR)
        self.kv.take_pending_loads()  # into blocks just freed
        self.kv.take_pending_copies()
        self.kv.check_integrity()
        self._publish_kv_events()
        return ids

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        with named_range("schedule"):  # `kvserve bench step --profile` breaks a step down by these
            out = self._step_out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.loading:  # nothing to run but loads from the tiers: wait for one
                self.store.wait_for_loads(self.kv.loads.values(), timeout=0.005)
            return []
        sampled = self.runner.execute(out)
        with named_range("process_outputs"):
            updated = self.scheduler.update_from_output(out, sampled)
            stopped = self.output_processor.update_text(updated)
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            outputs = self.output_processor.make_outputs(updated)
            self.stats.record_step(self.scheduler, out, updated, outputs, time.perf_counter() - start)
        if self.transfer is not None:
            with named_range("kv_tiers"):
                self.transfer.save(self.kv.take_pending_saves())  # blocks this step filled
        self._publish_kv_events()
        self._check_if_idle()
        return outputs

    def _publish_kv_events(self) -> None:
        """The device pool's events since the last call, as one batch (the tiers publish their own)."""
        if self.kv_events is not None and (events := self.kv.take_events()):
            self.kv_events.publish(events)

    def shutdown(self) -> None:
        """Write back every cached block the tiers do not hold yet (so a restart finds it), and
        close them, then the KV event publisher. The engine takes no request after this."""
        if self.store is not None:
            if self.transfer is not None and self.kv.store is not None and self.store.saves_on_evict:
                self.transfer.save(self.kv.cached_block_saves())
            self.store.flush()  # the tiers' last events are queued by now
            self.store.close()
            self.store = self.kv.store = self.transfer = self.runner.transfer = None
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()
            self.kv_events = None

    def _check_if_idle(self) -> None:
        """With check_invariants, at idle: the pool's and the prefix cache's own invariants, and no
        block in use but those a prefill replica holds for a decode replica."""
        if self.check_invariants and not self.has_unfinished_requests():
            self.kv.check_integrity()
            used, leased = self.kv.pool.num_used_blocks, self.kv.num_leased_blocks
            assert used == leased, f"{used} blocks in use at idle, {leased} of them leased"


def make_kv_event_publisher(config: EngineConfig) -> ZmqEventPublisher | None:
    if config.kv_events_endpoint is None:
        return None
    replay = config.kv_events_replay_endpoint or default_replay_endpoint(config.kv_events_endpoint)
    return ZmqEventPublisher(
        config.kv_events_endpoint, replay, config.kv_events_topic, encoding=config.kv_events_encoding
    )


def kv_namespace(
    model_dir: Path,
    kv_caches: list[torch.Tensor],
    weight_dtype: torch.dtype,
    block_size: int,
    compute_dtype: torch.dtype | None = None,
    *,
    quant_scheme: str,
) -> Namespace:
    """What a stored or handed-off block's bytes depend on besides its tokens."""
    kv_dtype = kv_caches[0].dtype
    return Namespace(
        model_fingerprint(model_dir),
        kv_dtype_name(kv_dtype),
        block_size,
        block_shape(kv_caches),
        None if weight_dtype == kv_dtype else str(weight_dtype).removeprefix("torch."),
        # K/V computed in fp32 and stored as bf16 are not the bytes bf16 compute stores
        None if compute_dtype in (None, kv_dtype) else str(compute_dtype).removeprefix("torch."),
        quant_scheme if kv_dtype == torch.uint8 else None,
    )


def make_kv_store(
    config: EngineConfig,
    namespace: Namespace,
    on_accelerator: bool,
    on_events: EventSink | None = None,
    handoff_bytes: int = 0,
) -> TieredKVStore | None:
    """The tiers the config turns on, in order: host RAM, disk, Redis (or a Redis Cluster), and on a decode replica
    the blocks pulled from prefill replicas; None if none is."""
    host = config.kv_host_bytes(on_accelerator)
    disk = config.kv_disk_bytes()
    if not host and not disk and not config.kv_remote and not handoff_bytes:
        return None
    tiers = []
    for name, size in (("kv_host_memory", host), ("kv_disk_size", disk)):
        if 0 < size < namespace.block_nbytes:  # such a tier would drop every block, starving the ones below
            raise ValueError(f"{name}={size} bytes holds no KV block ({namespace.block_nbytes} bytes); use 0 for none")
    if host:
        tiers.append(HostTier(host, namespace.block_nbytes))
    if disk:
        tiers.append(DiskTier(config.kv_disk_path(), disk, namespace))
    if config.kv_remote:
        tiers.append(remote_tier(config.kv_remote, namespace))
    if handoff_bytes:
        tiers.append(HandoffTier(handoff_bytes))
    logger.info("KV tiers: %s (%s)", ", ".join(t.name for t in tiers), config.kv_write_policy)
    return TieredKVStore(namespace, tiers, config.kv_write_policy, on_events=on_events)
