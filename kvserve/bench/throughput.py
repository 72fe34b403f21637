"""Offline throughput: every request queued at once, run to completion, tokens per second and KV use."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import BenchRequest
from kvserve.bench.hf_baseline import HFResult
from kvserve.config import EngineConfig


@dataclass
class ThroughputResult:
    workload: str
    model: str
    dtype: str
    device: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    wall_time_s: float  # generate() only: model load and workload sampling excluded
    cpu_time_s: float  # this process, same span; not contention-proof either (idle OpenMP threads spin)
    output_tok_per_s: float
    total_tok_per_s: float
    output_tok_per_cpu_s: float
    num_steps: int
    num_preemptions: int
    kv_pool_blocks: int
    block_size: int
    peak_kv_blocks_used: int
    kv_waste: float  # allocated-but-unused slots / allocated slots, summed over steps
    peak_running: int  # most requests in one step's batch
    prefix_cache_hit_rate: float  # prompt tokens found cached at admission / looked up
    max_num_seqs: int
    max_model_len: int
    longest_request_tokens: int  # longest prompt + its max_tokens
    # how many requests a contiguous reservation of the same pool would hold at once
    contiguous_at_max_model_len: int  # pool tokens // max_model_len
    contiguous_at_longest_request: int  # pool tokens // longest_request_tokens
    baseline: HFResult | None = None
    output_tok_per_s_vs_hf: float | None = None
    total_tok_per_s_vs_hf: float | None = None
    output_tok_per_cpu_s_vs_hf: float | None = None

    @property
    def pool_tokens(self) -> int:
        return self.kv_pool_blocks * self.block_size

    def attach_baseline(self, hf: HFResult) -> None:
        self.baseline = hf
        self.output_tok_per_s_vs_hf = self.output_tok_per_s / hf.output_tok_per_s
        self.total_tok_per_s_vs_hf = self.total_tok_per_s / hf.total_tok_per_s
        self.output_tok_per_cpu_s_vs_hf = self.output_tok_per_cpu_s / hf.output_tok_per_cpu_s


def sampling_params(request: BenchRequest) -> SamplingParams:
    # greedy and exact lengths: the work is fixed by the workload, not by what the model says
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)


def run_throughput(
    config: EngineConfig, requests: list[BenchRequest], workload: str = "custom", use_tqdm: bool = False
) -> ThroughputResult:
    llm = LLM(**vars(config))
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([r.prompt_token_ids for r in requests], [sampling_params(r) for r in requests], use_tqdm)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = _result(llm, requests, workload, output_tokens, (wall, cpu))
    del llm, outputs  # free the KV pool before a baseline loads its own model
    gc.collect()
    return result


def _result(
    llm: LLM, requests: list[BenchRequest], workload: str, output_tokens: int, times: tuple[float, float]
) -> ThroughputResult:
    wall, cpu = times
    engine = llm.llm_engine
    stats = engine.stats
    input_tokens = sum(len(r.prompt_token_ids) for r in requests)
    pool_tokens = engine.kv.pool.num_blocks * engine.config.block_size
    max_model_len = engine.scheduler.config.max_model_len
    longest = max(r.total_tokens for r in requests)
    return ThroughputResult(
        workload=workload,
        model=engine.config.model,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        num_requests=len(requests),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        wall_time_s=wall,
        cpu_time_s=cpu,
        output_tok_per_s=output_tokens / wall,
        total_tok_per_s=(input_tokens + output_tokens) / wall,
        output_tok_per_cpu_s=output_tokens / cpu,
        num_steps=stats.num_steps,
        num_preemptions=stats.num_preemptions,
        kv_pool_blocks=engine.kv.pool.num_blocks,
        block_size=engine.config.block_size,
        peak_kv_blocks_used=stats.peak_kv_blocks_used,
        kv_waste=stats.kv_waste,
        peak_running=stats.peak_running,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        max_num_seqs=engine.config.max_num_seqs,
        max_model_len=max_model_len,
        longest_request_tokens=longest,
        contiguous_at_max_model_len=pool_tokens // max_model_len,
        contiguous_at_longest_request=pool_tokens // longest,
    )


def print_table(result: ThroughputResult, console: Console | None = None) -> None:
    r, hf = result, result.baseline
    table = Table(
        title=f"kvserve bench throughput: {r.workload}, {r.model} ({r.dtype}, {r.device})",
        caption="KV waste: allocated-but-unused slots / allocated slots, summed over steps. "
        "contiguous: pool tokens // tokens reserved per request.",
    )
    for name in ("metric", "kvserve") + ((f"hf (batch {hf.batch_size})", "kvserve/hf") if hf else ()):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for row in _rows(r):
        table.add_row(*(row if hf else row[:2]))
    (console or Console()).print(table)


def _rows(r: ThroughputResult) -> list[tuple[str, str, str, str]]:
    hf = r.baseline

    def both(name: str, ours: str, theirs: str | None = "", ratio: float | None = None) -> tuple[str, str, str, str]:
        return name, ours, theirs or "", f"{ratio:.2f}x" if ratio is not None else ""

    def rate(name: str, attr: str, ratio: float | None) -> tuple[str, str, str, str]:
        return both(name, f"{getattr(r, attr):.1f}", hf and f"{getattr(hf, attr):.1f}", ratio)

    return [
        both("requests", str(r.num_requests), hf and str(hf.num_requests)),
        both("input tokens", str(r.input_tokens), hf and str(hf.input_tokens)),
        both("output tokens", str(r.output_tokens), hf and str(hf.output_tokens)),
        both("tokens generated", str(r.output_tokens), hf and str(hf.generated_tokens)),
        both("wall time (s)", f"{r.wall_time_s:.2f}", hf and f"{hf.wall_time_s:.2f}"),
        both("CPU time (s)", f"{r.cpu_time_s:.2f}", hf and f"{hf.cpu_time_s:.2f}"),
        rate("output tok/s", "output_tok_per_s", r.output_tok_per_s_vs_hf),
        rate("total tok/s", "total_tok_per_s", r.total_tok_per_s_vs_hf),
        rate("output tok/CPU-s", "output_tok_per_cpu_s", r.output_tok_per_cpu_s_vs_hf),
        both("peak concurrent", f"{r.peak_running} (cap {r.max_num_seqs})", hf and str(hf.batch_size)),
        both("KV pool tokens", f"{r.pool_tokens} ({r.kv_pool_blocks}x{r.block_size})"),
        both("peak KV blocks", f"{r.peak_kv_blocks_used} ({r.peak_kv_blocks_used / r.kv_pool_blocks:.1%})"),
        both("KV waste", f"{r.kv_waste:.2%}"),
        both("prefix cache hit rate", f"{r.prefix_cache_hit_rate:.1%}"),
        both(f"contiguous @max_model_len {r.max_model_len}", str(r.contiguous_at_max_model_len)),
        both(f"contiguous @longest req {r.longest_request_tokens}", str(r.contiguous_at_longest_request)),
        both("steps / preemptions", f"{r.num_steps} / {r.num_preemptions}"),
    ]
