"""Decode-step anatomy: time per step at fixed batch sizes, against this machine's roofline.

Each batch size gets `batch_size` requests of `context_len` random prompt tokens,
prefilled first; then `steps` pure decode steps are timed (median). A large batch is
judged against the measured matmul limit (FLOPs per token = 2 x matmul weights), batch
1 against the bytes a step must read at the measured bandwidth: every matmul weight once,
and each decode's K/V (at the KV dtype, scales included; a window layer its window). With
`profile`, one more run of steps under torch.profiler splits a step into the engine's
named ranges (schedule, prepare_inputs, model_forward, logits, sample,
process_outputs) and the forward into matmuls, attention, KV writes and the rest.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from kvserve.bench.roofline import Roofline
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

STEP_RANGES = ("schedule", "prepare_inputs", "model_forward", "logits", "sample", "process_outputs")
# outermost op whose name starts with one of these counts, inclusive of what it calls
FORWARD_CATEGORIES = {
    "matmul": (
        "aten::linear",
        "aten::mm",
        "aten::addmm",
        "aten::matmul",
        "mkldnn::_linear_pointwise",
        "kvserve::small_batch_linear",
    ),
    "attention": ("kvserve::paged_attention", "kvserve::prefill_attention", "aten::scaled_dot_product_attention"),
    "kv_write": ("aten::index_copy_", "kvserve::write_kv"),
}


@dataclass
class StepResult:
    batch_size: int
    context_len: int
    step_ms: float  # median of the timed decode steps
    tok_per_s: float
    gflops: float  # matmul FLOPs done per second (attention not counted)
    matmul_limit_share: float  # gflops / measured matmul limit
    weight_gb_per_s: float  # matmul weights read per second (each once per step)
    kv_gb_per_s: float  # K/V read per second (each decode's context once per step)
    bandwidth_limit_share: float  # (weight_gb_per_s + kv_gb_per_s) / measured read bandwidth
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per step, from the profiled run


def matmul_weights(engine: LLMEngine) -> tuple[int, int]:
    """(weights multiplied per token, their bytes), from the config: packed weights are not parameters.
    Bytes at the dtype their values have (bf16 for fp32 compute on rounded weights: what the kernel reads)."""
    params = engine.model_config.matmul_params_per_token()
    return params, params * engine.weight_dtype.itemsize


def kv_read_bytes(engine: LLMEngine, batch_size: int, context_len: int) -> int:
    """K/V a decode step of `batch_size` requests at `context_len` reads, as stored."""
    return batch_size * engine.kv_config.read_bytes(context_len, engine.kv_layer_bytes_per_token)


def fill_decode_batch(engine: LLMEngine, batch_size: int, context_len: int, max_tokens: int, seed: int) -> list[str]:
    """Queue `batch_size` requests and step until every one is past its prefill."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(context_len)], params) for _ in range(batch_size)]
    while engine.scheduler.waiting or engine.stats.last_step is None or engine.stats.last_step.num_prefill_tokens:
        engine.step()
    return ids


def time_decode_steps(engine: LLMEngine, batch_size: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.stats.last_step.num_decode_tokens != batch_size:
            raise RuntimeError(f"a step decoded {engine.stats.last_step.num_decode_tokens} tokens, not {batch_size}")
    return times


def profile_steps(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Mean ms per step in each named range and forward category; `python_other` is the rest."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    ms = {name: _inclusive_ms(events, (name,), None) / steps for name in STEP_RANGES}
    for category, prefixes in FORWARD_CATEGORIES.items():
        ms[f"forward.{category}"] = _inclusive_ms(events, prefixes, "model_forward") / steps
    ms["forward.other"] = ms["model_forward"] - sum(ms[f"forward.{c}"] for c in FORWARD_CATEGORIES)
    ms["step_total_profiled"] = wall_ms / steps
    ms["python_other"] = ms["step_total_profiled"] - sum(ms[name] for name in STEP_RANGES)
    return ms


def _inclusive_ms(events: list[FunctionEvent], prefixes: tuple[str, ...], inside: str | None) -> float:
    """Sum of inclusive CPU time of the outermost events named by `prefixes` (under `inside`)."""
    total_us = 0.0
    for evt in events:
        if not evt.name.startswith(prefixes):
            continue
        ancestors = list(_ancestors(evt))
        if any(a.name.startswith(prefixes) for a in ancestors):
            continue  # counted with its outermost matching ancestor
        if inside is None or any(a.name == inside for a in ancestors):
            total_us += evt.cpu_time_total
    return total_us / 1e3


def _ancestors(evt: FunctionEvent):
    parent = evt.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def run_step_bench(
    engine: LLMEngine, roofline: Roofline, batch_size: int, context_len: int, steps: int, with_profile: bool, seed: int
) -> StepResult:
    warmup, profiled = 3, steps if with_profile else 0
    # requests admitted early decode while later ones prefill, and their decodes take part
    # of each step's token budget: leave room for all of those steps (a bound, not exact)
    budget = max(1, engine.config.max_num_batched_tokens - batch_size)
    fill_steps = 2 * -(-batch_size * context_len // budget) + 1
    ids = fill_decode_batch(engine, batch_size, context_len, fill_steps + warmup + steps + profiled, seed)
    time_decode_steps(engine, batch_size, warmup)
    step_s = statistics.median(time_decode_steps(engine, batch_size, steps))
    breakdown = profile_steps(engine, profiled) if with_profile else {}
    for request_id in ids:  # frees the blocks at once: the next batch size starts from an idle pool
        engine.abort_request(request_id)
    params, weight_bytes = matmul_weights(engine)
    gflops = batch_size * 2 * params / step_s / 1e9
    weight_gb_per_s = weight_bytes / step_s / 1e9
    kv_gb_per_s = kv_read_bytes(engine, batch_size, context_len) / step_s / 1e9
    return StepResult(
        batch_size=batch_size,
        context_len=context_len,
        step_ms=step_s * 1e3,
        tok_per_s=batch_size / step_s,
        gflops=gflops,
        matmul_limit_share=gflops / roofline.matmul_gflops,
        weight_gb_per_s=weight_gb_per_s,
        kv_gb_per_s=kv_gb_per_s,
        bandwidth_limit_share=(weight_gb_per_s + kv_gb_per_s) / roofline.read_gb_per_s,
        breakdown_ms=breakdown,
    )


def print_table(results: list[StepResult], roofline: Roofline) -> None:
    console = Console()
    pages = f" (on {roofline.read_pages})" if roofline.read_pages else ""
    console.print(
        f"roofline ({roofline.dtype}, {roofline.device}): matmul {roofline.matmul_gflops:.0f} GFLOP/s, "
        f"memory read {roofline.read_gb_per_s:.1f} GB/s{pages}"
    )
    table = Table(title="decode step")
    columns = ("batch", "context", "step ms", "tok/s", "GFLOP/s", "of matmul limit", "weights GB/s", "KV GB/s",
               "of bandwidth")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.batch_size), str(r.context_len), f"{r.step_ms:.2f}", f"{r.tok_per_s:.0f}", f"{r.gflops:.0f}",
            f"{r.matmul_limit_share:.0%}", f"{r.weight_gb_per_s:.1f}", f"{r.kv_gb_per_s:.1f}",
            f"{r.bandwidth_limit_share:.0%}",
        )  # fmt: skip
    console.print(table)
    for r in results:
        if r.breakdown_ms:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r.breakdown_ms.items())
            console.print(f"batch {r.batch_size}, ms per step (profiled): {parts}")
