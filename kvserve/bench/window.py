"""`kvserve bench window`: what releasing sliding-window blocks buys, in one fixed KV pool.

A sliding-window model (Gemma 3: a 512-token window on 5 of every 6 layers) runs the same
long-context workload twice in a pool of the same size: with the hybrid KV cache (one block
table per KV group, window blocks back in the pool once the window has passed them) and
with `disable_hybrid_kv_cache_manager` (every layer keeps its whole history, as if it
attended to all of it). Reported per mode: the KV blocks and bytes one request holds at its
largest, the most requests decoding together, preemptions, output tokens per second; and
whether the greedy outputs are the same (they must be: the window's keys are kept either way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.loader import load_config, resolve_model
from kvserve.sampling_params import SamplingParams


@dataclass
class WindowRun:
    mode: str  # "hybrid" or "full"
    dtype: str
    kv_groups: int
    pool_blocks: int
    block_bytes: int
    peak_blocks_per_request: int  # every group's blocks one request held, at its largest
    peak_bytes_per_request: int
    peak_decoding: int  # the most requests decoding together (prompt done), after a step
    capacity: int  # requests of this size the pool holds at once: pool blocks // peak blocks per request
    num_preemptions: int
    output_tokens: int
    wall_time_s: float
    output_tok_per_s: float


@dataclass
class WindowResult:
    model: str
    dtype: str
    kv_cache_memory: str
    context_len: int
    output_len: int
    num_prompts: int
    hybrid: WindowRun
    full: WindowRun
    kv_memory_saved: float  # 1 - hybrid bytes per request / full bytes per request
    concurrency_gain: float  # hybrid peak decoding / full peak decoding
    same_outputs: bool
    # prompts whose greedy tokens agree: all of them in float32; bfloat16 results depend on the
    # batch's shape (the modes batch differently), so a near tie may flip there
    matching_outputs: int


def sample_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(num)]


def held_blocks(engine: LLMEngine, seq_id: int) -> int:
    kv = engine.kv
    tables = [kv.block_tables.get(seq_id, [])] + [t.get(seq_id, []) for t in kv.group_tables]
    return sum(1 for table in tables for b in table if b is not None)


def run_mode(config: EngineConfig, prompts: list[list[int]], output_len: int, mode: str) -> tuple[WindowRun, list]:
    engine = LLMEngine(replace(config, disable_hybrid_kv_cache_manager=mode == "full"))
    cfg = engine.model_config
    layer_bytes = engine.kv_bytes_per_token // cfg.num_hidden_layers
    block_bytes = engine.kv_config.block_bytes(layer_bytes, config.block_size)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    peak_blocks = peak_decoding = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        running = engine.scheduler.running
        # requests still in their prefill may be preempted again: only the decoding ones count
        peak_decoding = max(peak_decoding, sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running))
        peak_blocks = max([peak_blocks] + [held_blocks(engine, r.seq_id) for r in running])
    wall = time.perf_counter() - start
    produced = sum(len(t) for t in outputs.values())
    pool = engine.kv.pool.num_blocks
    run = WindowRun(
        mode, str(engine.dtype).removeprefix("torch."), engine.kv_config.num_groups, pool, block_bytes,
        peak_blocks, peak_blocks * block_bytes,
        peak_decoding, pool // max(peak_blocks, 1), engine.scheduler.num_preemptions, produced, wall, produced / wall,
    )  # fmt: skip
    return run, [outputs[i] for i in ids]


def run_window_bench(
    config: EngineConfig, context_len: int, output_len: int, num_prompts: int, seed: int, log=print
) -> WindowResult:
    model_config = load_config(resolve_model(config.model))
    if not model_config.has_sliding_window:
        raise SystemExit(f"{config.model} has no sliding-window layers: nothing to release")
    prompts = sample_prompts(num_prompts, context_len, model_config.vocab_size, seed)
    runs, outputs = {}, {}
    for mode in ("hybrid", "full"):
        log(f"running {num_prompts} x {context_len}-token prompts, {mode} KV")
        runs[mode], outputs[mode] = run_mode(config, prompts, output_len, mode)
    hybrid, full = runs["hybrid"], runs["full"]
    return WindowResult(
        config.model, hybrid.dtype, str(config.kv_cache_memory), context_len, output_len, num_prompts,
        hybrid, full, 1 - hybrid.peak_bytes_per_request / full.peak_bytes_per_request,
        hybrid.peak_decoding / max(full.peak_decoding, 1), outputs["hybrid"] == outputs["full"],
        sum(a == b for a, b in zip(outputs["hybrid"], outputs["full"], strict=True)),
    )  # fmt: skip


def print_table(r: WindowResult) -> None:
    title = f"{r.model} ({r.dtype}): {r.num_prompts} x {r.context_len}-token prompts + {r.output_len} tokens"
    table = Table(title=f"{title}, KV pool {r.kv_cache_memory}")
    columns = ("KV", "groups", "pool blocks", "KV per request", "decoding together", "fits", "preempted", "tok/s")
    for col in columns:
        table.add_column(col)
    for run in (r.hybrid, r.full):
        name = "windows released" if run.mode == "hybrid" else "every layer full"
        table.add_row(
            name, str(run.kv_groups), str(run.pool_blocks),
            f"{run.peak_blocks_per_request} blocks = {run.peak_bytes_per_request / 2**20:.1f} MiB",
            str(run.peak_decoding), str(run.capacity), str(run.num_preemptions), f"{run.output_tok_per_s:.1f}",
        )  # fmt: skip
    Console().print(table)
    print(
        f"KV memory per request: {100 * r.kv_memory_saved:.1f}% less; "
        f"requests decoding together: {r.concurrency_gain:.2f}x; "
        f"same greedy outputs: {r.matching_outputs} of {r.num_prompts} prompts ({r.dtype})"
    )
