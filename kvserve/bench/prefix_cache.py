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
import statistics
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.conversations import Conversation
from kvserve.bench.datasets import BenchRequest
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import apply_chat_template

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
    merged: dict[str, Any] = {}
    for f in fields(PrefixBenchResult):
        values = [getattr(r, f.name) for r in results]
        if all(isinstance(v, (int, float)) for v in values):
            merged[f.name] = statistics.median(values)
        else:
            merged[f.name] = None if None in values else values[0]
    return PrefixBenchResult(**merged)


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
    engine: LLMEngine, conversations: list[Conversation], concurrency: int
) -> tuple[list[_Finished], float, str]:
    chats: dict[int, list[dict[str, str]]] = {}
    todo = list(range(len(conversations)))
    finished: list[_Finished] = []

    def send(c: int) -> None:
        turn = len(chats.setdefault(c, [])) // 2
        chats[c].append({"role": "user", "content": conversations[c].user_turns[turn]})
        # exact lengths by min_tokens, as vLLM's multi-turn benchmark: the end-of-turn token is
        # masked, where ignore_eos would let it into the reply, drop it from the text and
        # break the next turn's match there (11 of 14 prefix misses on ShareGPT)
        length = conversations[c].reply_tokens[turn]
        params = SamplingParams(temperature=0, max_tokens=length, min_tokens=length)
        engine.add_request(apply_chat_template(engine.tokenizer, chats[c]), params, request_id=f"{c}/{turn}")

    start = time.perf_counter()
    for _ in range(min(concurrency, len(todo))):
        send(todo.pop(0))
    while engine.has_unfinished_requests():
        for out in (o for o in engine.step() if o.finished):
            c, turn = map(int, out.request_id.split("/"))
            finished.append(_Finished(out, turn))
            chats[c].append({"role": "assistant", "content": out.outputs[0].text})
            if turn + 1 < len(conversations[c].user_turns):
                send(c)
            elif todo:
                send(todo.pop(0))
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
