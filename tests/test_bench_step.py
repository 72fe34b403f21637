"""`kvserve bench step` on the tiny model: batches are what they claim, the profile adds up, nothing leaks."""

from __future__ import annotations

import torch

from kvserve.bench import roofline
from kvserve.bench.roofline import Roofline, matmul_gflops, read_gb_per_s
from kvserve.bench.step import FORWARD_CATEGORIES, STEP_RANGES, kv_read_bytes, matmul_weights, run_step_bench
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.loader import iter_weights
from kvserve.platforms.huge_pages import PLAIN, RESERVED, TRANSPARENT, huge_page_buffer

LIMITS = Roofline("float32", matmul_gflops=100.0, read_gb_per_s=10.0)  # fixed: the test checks arithmetic


def tiny_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=8))


def test_matmul_weights_count_every_projection_and_the_head(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    # the checkpoint's tensors: the engine's weights are packed, no longer parameters
    weights = dict(iter_weights(tiny_model_dir))
    projections = [w for name, w in weights.items() if w.dim() == 2 and "layers." in name]
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    expected = sum(w.numel() for w in projections) + head.numel()
    assert matmul_weights(engine) == (expected, 4 * expected)


def test_step_bench_decodes_the_batch_and_frees_it(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    params, weight_bytes = matmul_weights(engine)
    for batch_size in (1, 5):
        r = run_step_bench(engine, LIMITS, batch_size, context_len=20, steps=3, with_profile=True, seed=0)
        assert r.tok_per_s == batch_size / (r.step_ms / 1e3)
        assert abs(r.gflops - batch_size * 2 * params / (r.step_ms / 1e3) / 1e9) < 1e-9
        assert r.matmul_limit_share == r.gflops / LIMITS.matmul_gflops
        kv_bytes = kv_read_bytes(engine, batch_size, 20)
        assert kv_bytes == batch_size * 20 * engine.kv_bytes_per_token
        assert r.kv_gb_per_s == kv_bytes / (r.step_ms / 1e3) / 1e9
        assert r.bandwidth_limit_share == (r.weight_gb_per_s + r.kv_gb_per_s) / LIMITS.read_gb_per_s
        assert set(STEP_RANGES) <= r.breakdown_ms.keys()
        assert r.breakdown_ms["model_forward"] > 0 and r.breakdown_ms["forward.matmul"] > 0
        parts = [f"forward.{c}" for c in (*FORWARD_CATEGORIES, "other")]
        forward_parts = sum(r.breakdown_ms[p] for p in parts)
        assert abs(forward_parts - r.breakdown_ms["model_forward"]) < 1e-6
        assert not engine.has_unfinished_requests()
        assert engine.kv.pool.num_used_blocks == 0


def test_roofline_measures_positive_rates():
    cpu = torch.device("cpu")
    assert matmul_gflops(torch.float32, cpu, m=64, k=64, n=64, repeats=2) > 0
    rate, pages = read_gb_per_s(cpu, size_bytes=1 << 20, repeats=2)
    assert rate > 0 and pages in (PLAIN, RESERVED, TRANSPARENT)


def test_cpu_read_bandwidth_is_also_measured_on_the_weights_huge_pages(monkeypatch):
    asked = []

    def buffer(nbytes: int):
        asked.append(nbytes)
        return huge_page_buffer(nbytes)

    monkeypatch.setattr(roofline, "huge_page_buffer", buffer)
    assert read_gb_per_s(torch.device("cpu"), size_bytes=1 << 20, repeats=2)[0] > 0
    assert asked == [1 << 20]
