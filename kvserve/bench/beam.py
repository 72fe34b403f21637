"""`kvserve bench beam`: beam search in the engine against transformers' `generate(num_beams=...)`.

The same prompts (ShareGPT first turns cut to `prompt_len` tokens, so that transformers'
batches need no padding) through both, in this process, for each beam width. kvserve queues
every prompt at once (continuous batching, beams sharing KV blocks); transformers runs static
batches of `hf_batch_size` prompts (each `beam_width` rows). Output tokens are the returned
beams' generated tokens (`beam_width` x `output_len` per prompt, EOS ignored), the same work on
both sides.

KV blocks, as in the PagedAttention paper's beam-search figure: the blocks in use at the
busiest step, beams sharing every block of their common history, against what the same beams
would hold as separate sequences (each its own copy of its whole table) at their own peak.

With `vllm_python`, vLLM's `LLM.beam_search` (a Python loop over its engine, prefix caching
sharing the prompt's blocks) runs the same prompts afterwards, in a child process of that
Python (`vllm_beam_worker.py`), while this process idles.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvserve.bench.datasets import first_turns, iter_json_array, sharegpt_path
from kvserve.bench.hf_baseline import load_hf_model
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import BeamSearchParams


@dataclass
class BeamWidthResult:
    beam_width: int
    output_tokens: int  # the returned beams' generated tokens
    wall_time_s: float
    output_tok_per_s: float
    num_steps: int
    num_preemptions: int
    peak_kv_blocks: int  # in use at the busiest step, beams sharing blocks
    peak_kv_blocks_separate: int  # every live beam's table summed: separate sequences
    kv_blocks_saved: float  # 1 - peak_kv_blocks / peak_kv_blocks_separate
    hf_wall_time_s: float | None = None
    hf_output_tok_per_s: float | None = None
    speedup_vs_hf: float | None = None
    same_beams_as_hf: float | None = None  # prompts whose returned beams equal transformers', token for token
    vllm_output_tok_per_s: float | None = None
    speedup_vs_vllm: float | None = None
    same_beams_as_vllm: float | None = None
    vllm_error: str | None = None  # what vLLM raised for this width


@dataclass
class BeamBenchResult:
    model: str
    dtype: str
    device: str
    workload: str
    num_prompts: int
    prompt_len: int
    output_len: int
    block_size: int
    hf_batch_size: int | None
    widths: list[BeamWidthResult] = field(default_factory=list)
    vllm_version: str | None = None


@dataclass(frozen=True)
class VllmBaseline:
    python: Path  # a Python with vLLM installed
    model: Path  # the same weights as a Hugging Face checkpoint, which vLLM loads

    def env(self) -> dict[str, str]:
        """vLLM-cpu's settings in the peers' start script: 4 GiB of KV, a thread bound to each of our CPUs."""
        cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        return {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def sample_prompts(
    workload: str, model_dir: Path, num_prompts: int, prompt_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """ShareGPT first turns of at least `prompt_len` tokens, cut to that; or random tokens."""
    if prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"--prompt-len and --num-prompts must be >= 1, got {prompt_len} and {num_prompts}")
    rng = random.Random(seed)
    if workload == "random":
        return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]
    from kvserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    pairs = list(first_turns(iter_json_array(sharegpt_path().read_text(encoding="utf-8"))))
    rng.shuffle(pairs)
    prompts = []
    for text, _ in pairs:
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
            if len(prompts) == num_prompts:
                return prompts
    raise ValueError(f"only {len(prompts)} ShareGPT prompts have {prompt_len} tokens or more, asked {num_prompts}")


def run_kvserve(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> tuple[BeamWidthResult, list]:
    """Every prompt at once; the blocks in use and the beams' tables summed, after every step."""
    start = time.perf_counter()
    steps0, preempt0 = engine.stats.num_steps, engine.stats.num_preemptions
    ids = [engine.add_request(p, params) for p in prompts]
    done, peak, peak_separate = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        beams = [r for r in engine.scheduler.running if r.beam is not None]
        peak = max(peak, engine.kv.pool.num_used_blocks)
        peak_separate = max(peak_separate, sum(len(engine.kv.block_tables.get(r.seq_id, ())) for r in beams))
    wall = time.perf_counter() - start
    outputs = [done[i] for i in ids]
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = BeamWidthResult(
        beam_width=params.beam_width,
        output_tokens=tokens,
        wall_time_s=wall,
        output_tok_per_s=tokens / wall,
        num_steps=engine.stats.num_steps - steps0,
        num_preemptions=engine.stats.num_preemptions - preempt0,
        peak_kv_blocks=peak,
        peak_kv_blocks_separate=peak_separate,
        kv_blocks_saved=1 - peak / peak_separate if peak_separate else 0.0,
    )
    return result, [[c.token_ids for c in o.outputs] for o in outputs]


def run_hf(model, prompts: list[list[int]], width: int, output_len: int, batch_size: int) -> tuple[float, list]:
    """transformers' beam search on the same prompts, in static batches; (wall time, beams)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    # kvserve's ignore_eos: an EOS id past the vocabulary, which never comes (None would be the
    # checkpoint's); both keep 2 x width candidates a step and every beam runs output_len tokens
    gen = GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=output_len,
        early_stopping=False,
        length_penalty=1.0,
        eos_token_id=[model.config.vocab_size],
        pad_token_id=0,
    )
    beams = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size], device=device)
        with torch.inference_mode():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=gen)
        rows = out[:, batch.shape[1] :].tolist()
        beams += [rows[j : j + width] for j in range(0, len(rows), width)]
    return time.perf_counter() - start, beams


def run_vllm(baseline: VllmBaseline, dtype: str, prompts: list[list[int]], widths: list[int], output_len: int) -> dict:
    """vLLM's beam search on the same prompts, per width (see vllm_beam_worker.py)."""
    spec = {
        "model": str(baseline.model), "dtype": dtype, "prompts": prompts, "widths": widths,
        "output_len": output_len, "max_model_len": len(prompts[0]) + output_len + 16,
    }  # fmt: skip
    worker = Path(__file__).with_name("vllm_beam_worker.py")
    with tempfile.TemporaryDirectory(prefix="kvserve-vllm-beam-") as tmp:
        spec["out"] = out = str(Path(tmp) / "result.json")
        done = subprocess.run(
            [str(baseline.python), str(worker)], input=json.dumps(spec), capture_output=True, text=True,
            env=os.environ | baseline.env(),
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's beam search failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(Path(out).read_text())


def add_vllm_results(bench: BeamBenchResult, found: dict, ours: dict[int, list]) -> None:
    bench.vllm_version = found["vllm"]
    for result, theirs in zip(bench.widths, found["results"], strict=True):
        if "error" in theirs:
            result.vllm_error = theirs["error"]
            continue
        result.vllm_output_tok_per_s = theirs["output_tokens"] / theirs["wall_time_s"]
        result.speedup_vs_vllm = result.output_tok_per_s / result.vllm_output_tok_per_s
        mine = ours[result.beam_width]
        result.same_beams_as_vllm = sum(a == b for a, b in zip(mine, theirs["beams"], strict=True)) / len(mine)


def run_beam_bench(
    config: EngineConfig,
    prompts: list[list[int]],
    widths: list[int],
    output_len: int,
    hf_batch_size: int | None,
    workload: str = "custom",
    log=print,
    vllm: VllmBaseline | None = None,
) -> BeamBenchResult:
    if min(widths) < 1 or output_len < 1:
        raise ValueError(f"--beam-widths and --output-len must be >= 1, got {widths} and {output_len}")
    engine = LLMEngine(config)
    dtype, device = engine.dtype, engine.device
    bench = BeamBenchResult(
        config.model, str(dtype).removeprefix("torch."), str(device), workload, len(prompts), len(prompts[0]),
        output_len, config.block_size, hf_batch_size,
    )  # fmt: skip
    # both models side by side, each width through one then the other: on a shared host the
    # two runs of a width see about the same load
    model = load_hf_model(engine.model_dir, dtype, device) if hf_batch_size else None
    beams_by_width = {}
    for width in widths:
        # warm up on this width's batch shapes (a first shape costs the kernels' set-up), then
        # start from an empty prefix cache: each width computes its prompts, as transformers does
        run_kvserve(engine, prompts, BeamSearchParams(width, 3, ignore_eos=True))
        engine.reset_prefix_cache()
        result, ours = run_kvserve(engine, prompts, BeamSearchParams(width, output_len, ignore_eos=True))
        beams_by_width[width] = ours
        saved = result.kv_blocks_saved
        log(f"kvserve, beam width {width}: {result.output_tok_per_s:.1f} output tok/s, KV blocks {saved:.0%} saved")
        bench.widths.append(result)
        if model is not None:
            run_hf(model, prompts[:hf_batch_size], width, 3, hf_batch_size)  # warm up, as above
            wall, beams = run_hf(model, prompts, width, output_len, hf_batch_size)
            result.hf_wall_time_s = wall
            result.hf_output_tok_per_s = result.output_tokens / wall
            result.speedup_vs_hf = result.output_tok_per_s / result.hf_output_tok_per_s
            result.same_beams_as_hf = sum(a == b for a, b in zip(ours, beams, strict=True)) / len(beams)
            log(f"transformers, beam width {width}: {result.hf_output_tok_per_s:.1f} output tok/s")
    if vllm is not None:
        log(f"vLLM's beam search through {vllm.python}, on {vllm.model}")
        add_vllm_results(bench, run_vllm(vllm, bench.dtype, prompts, widths, output_len), beams_by_width)
    return bench


def print_table(bench: BeamBenchResult, console: Console | None = None) -> None:
    title = (
        f"beam search: {bench.num_prompts} {bench.workload} prompts of {bench.prompt_len} tokens, "
        f"{bench.output_len} tokens per beam ({bench.model}, {bench.dtype}, {bench.device}, "
        f"block {bench.block_size}"
        + (f"; transformers in batches of {bench.hf_batch_size} prompts)" if bench.hf_batch_size else ")")
    )
    table = Table(title=title)
    for col in ("beam width", "kvserve tok/s", "transformers tok/s", "speedup", "same beams", "vLLM tok/s",
                "vs vLLM", "peak KV blocks", "as separate seqs", "saved", "preemptions"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in bench.widths:
        hf = r.hf_output_tok_per_s is not None
        table.add_row(
            str(r.beam_width),
            f"{r.output_tok_per_s:.1f}",
            f"{r.hf_output_tok_per_s:.1f}" if hf else "-",
            f"{r.speedup_vs_hf:.2f}x" if hf else "-",
            f"{r.same_beams_as_hf:.0%}" if hf else "-",
            _vllm_cell(r),
            f"{r.speedup_vs_vllm:.2f}x" if r.speedup_vs_vllm else "-",
            str(r.peak_kv_blocks),
            str(r.peak_kv_blocks_separate),
            f"{r.kv_blocks_saved:.1%}",
            str(r.num_preemptions),
        )
    (console or Console()).print(table)


def _vllm_cell(r: BeamWidthResult) -> str:
    if r.vllm_error:
        return "failed: " + r.vllm_error[:60]
    return f"{r.vllm_output_tok_per_s:.1f}" if r.vllm_output_tok_per_s else "-"
