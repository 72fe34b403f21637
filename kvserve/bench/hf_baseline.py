"""The baseline: the same requests through Hugging Face `generate` in static, left-padded batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.bench.datasets import MAX_TOTAL_TOKENS, BenchRequest


@dataclass
class HFResult:
    num_requests: int
    input_tokens: int
    output_tokens: int  # each request's own max_tokens: the useful output
    generated_tokens: int  # batch size x the batch's longest output, summed: what static batching computes
    padded_prompt_tokens: int  # batch size x the batch's longest prompt, summed
    wall_time_s: float
    cpu_time_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    output_tok_per_cpu_s: float
    batch_size: int
    num_batches: int


def static_batches(
    requests: list[BenchRequest], max_batch_size: int, max_tokens: int = MAX_TOTAL_TOKENS
) -> list[list[BenchRequest]]:
    """In order, as vLLM's HF baseline: close a batch when full or when padded length would pass max_tokens."""
    batches: list[list[BenchRequest]] = []
    batch: list[BenchRequest] = []
    for r in requests:
        grown = batch + [r]
        padded = max(len(x.prompt_token_ids) for x in grown) + max(x.max_tokens for x in grown)
        if batch and (len(batch) == max_batch_size or padded > max_tokens):
            batches.append(batch)
            grown = [r]
        batch = grown
    return batches + [batch] if batch else batches


def left_pad(batch: list[BenchRequest], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def generate_batch(model, batch: list[BenchRequest], pad_id: int, device: torch.device) -> int:
    """Run one static batch to its longest output; returns the tokens generated (useful or not)."""
    from transformers import GenerationConfig

    new = max(r.max_tokens for r in batch)
    # a fresh config: the checkpoint's own (sampling, repetition penalty...) must not leak in
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=pad_id,
        eos_token_id=model.config.eos_token_id,
        use_cache=True,
    )
    ids, mask = left_pad(batch, pad_id, device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    return (out.shape[1] - ids.shape[1]) * len(batch)


def run_hf_baseline(
    model_dir: Path, requests: list[BenchRequest], dtype: str, device: str, batch_size: int, use_tqdm: bool = True
) -> HFResult:
    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    torch_device = torch.device(device)
    model = load_hf_model(model_dir, getattr(torch, dtype), torch_device)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = static_batches(requests, batch_size)
    generated = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with tqdm(total=len(requests), desc="hf generate", disable=not use_tqdm) as bar:
        for batch in batches:
            generated += generate_batch(model, batch, pad_id, torch_device)
            bar.update(len(batch))
    times = time.perf_counter() - start, time.process_time() - cpu_start
    return _hf_result(requests, batches, generated, times, batch_size)


def _hf_result(
    requests: list[BenchRequest],
    batches: list[list[BenchRequest]],
    generated: int,
    times: tuple[float, float],
    batch_size: int,
) -> HFResult:
    wall, cpu = times
    input_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    padded = sum(len(b) * max(len(r.prompt_token_ids) for r in b) for b in batches)
    return HFResult(
        num_requests=len(requests),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        generated_tokens=generated,
        padded_prompt_tokens=padded,
        wall_time_s=wall,
        cpu_time_s=cpu,
        output_tok_per_s=output_tokens / wall,
        total_tok_per_s=(input_tokens + output_tokens) / wall,
        output_tok_per_cpu_s=output_tokens / cpu,
        batch_size=batch_size,
        num_batches=len(batches),
    )
