"""`kv_cache_dtype` (`--kv-cache-dtype`): how K/V are stored, apart from the compute dtype.

auto is bfloat16 wherever the attention path reads it under the compute dtype and float32
under `--dtype float32`; a K/V dtype the kernels cannot read runs on the PyTorch path, which
casts. Greedy outputs do not depend on where a prefix came from (same KV dtype), and a tier
record of one KV dtype is a miss for another.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import replica_info
from kvserve.engine_args import engine_config
from kvserve.entrypoints.cli import build_parser
from kvserve.kernels.build import available
from kvserve.layers.attention.backend import TorchAttention
from kvserve.platforms import KV_DTYPES, cpu_has_native_bf16, get_platform, resolve_kv_dtype
from kvserve.platforms.cpu import CpuPlatform

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int4'"):
        EngineConfig(kv_cache_dtype="int4")


def test_the_flag_sets_the_field():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert engine_config(args).kv_cache_dtype == "bfloat16"
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"


def test_auto_resolution():
    assert get_platform("cpu", "float32").kv_dtype == torch.float32  # a reference run
    assert get_platform("cpu", "bfloat16").kv_dtype == torch.bfloat16
    if cpu_has_native_bf16():
        assert get_platform("cpu", "auto").kv_dtype == torch.bfloat16
    # fp32 compute under auto (an AVX2 CPU): bf16, which the kernels and the PyTorch path both read
    fp32 = CpuPlatform(torch.device("cpu"), torch.float32)
    assert resolve_kv_dtype("auto", "auto", fp32) == torch.bfloat16


def test_auto_on_a_cpu_without_bf16_arithmetic(monkeypatch):
    """An AVX2-only CPU computes in fp32 on the kernels, which read bf16 K/V (widened as they read)."""
    monkeypatch.setattr("kvserve.platforms.cpu_has_native_bf16", lambda: False)
    platform = get_platform("cpu", "auto")
    assert platform.dtype == torch.float32
    assert platform.kv_dtype == torch.bfloat16
    if available():
        assert not isinstance(platform.attention_backend(64), TorchAttention)


@pytest.mark.parametrize(("dtype", "kv"), [("bfloat16", "float32")])
def test_a_kv_dtype_the_kernels_cannot_read_falls_back_to_the_pytorch_path(dtype, kv):
    platform = get_platform("cpu", dtype, kv)
    assert platform.kv_dtype == KV_DTYPES[kv]
    assert isinstance(platform.attention_backend(64), TorchAttention)


def bf16_kv_engine(model_dir: Path, dtype: str, kv: str = "bfloat16", **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype=dtype, kv_cache_dtype=kv, block_size=BLOCK, **kwargs)


@pytest.mark.parametrize(
    ("dtype", "kv"),
    [
        ("bfloat16", "bfloat16"),
        ("float32", "bfloat16"),
        ("bfloat16", "float32"),
        ("float32", "int8"),
        ("bfloat16", "int8"),
    ],
    ids=[
        "bf16-kernels",
        "bf16-kv-fp32-compute",
        "fp32-kv-bf16-compute",
        "int8-kv-fp32-compute",
        "int8-kv-bf16-compute",
    ],
)
def test_greedy_outputs_do_not_depend_on_a_prefix_hit(tiny_model_dir, dtype, kv):
    if dtype == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("bf16 compute needs AVX512-BF16 or AMX")
    llm = bf16_kv_engine(tiny_model_dir, dtype, kv, num_kv_blocks=64)
    cold = bf16_kv_engine(tiny_model_dir, dtype, kv, num_kv_blocks=64, enable_prefix_caching=False)
    first = prompt(1)
    turn = first + prompt(2, 30)
    (a,) = run(llm, [first])
    (hit,) = run(llm, [turn])
    (b,) = run(cold, [turn])
    assert hit.num_cached_tokens == (len(first) - 1) // BLOCK * BLOCK and b.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids == run(cold, [first])[0].outputs[0].token_ids
    # the same values, not only the same argmax: a cold prefill attends over its K/V as stored
    # (without rounding them the PyTorch path's logprobs differed by ~3e-5)
    assert [lp[t].logprob for lp, t in zip(hit.outputs[0].logprobs, hit.outputs[0].token_ids, strict=True)] == [
        lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids, strict=True)
    ]


def test_bf16_kv_holds_twice_the_tokens_of_fp32_and_says_so(tiny_model_dir, caplog):
    fp32 = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB").llm_engine
    with caplog.at_level(logging.INFO, logger="kvserve"):
        bf16 = bf16_kv_engine(tiny_model_dir, "float32", kv_cache_memory="1MiB").llm_engine
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    assert bf16.kv.pool.num_blocks == 2 * fp32.kv.pool.num_blocks
    assert bf16.runner.kv_caches[0].dtype == torch.bfloat16
    tokens = bf16.kv.pool.num_blocks * BLOCK
    line = f"= {tokens} tokens, {bf16.kv_bytes_per_token} bytes/token (KV dtype bfloat16, cpu; compute float32"
    assert any(line in r.getMessage() for r in caplog.records), caplog.text
    assert "attention runs on the PyTorch path" not in caplog.text  # the kernels (or PyTorch) read bf16 K/V
    info = replica_info(bf16)  # what /server_info reports
    assert (info.kv_cache_dtype, info.kv_bytes_per_token, info.kv_capacity_tokens) == (
        "bfloat16",
        bf16.kv_bytes_per_token,
        tokens,
    )


def test_a_tier_record_of_one_kv_dtype_is_a_miss_for_another(tiny_model_dir, tmp_path):
    kv = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB", "num_kv_blocks": 16, "block_size": BLOCK}
    first = LLM(model=str(tiny_model_dir), dtype="float32", **kv)
    run(first, [prompt(3)])
    first.llm_engine.shutdown()  # write-back: what the pool caches goes to disk
    other = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="bfloat16", **kv)
    (miss,) = run(other, [prompt(3)])
    assert miss.num_cached_tokens == 0 and other.llm_engine.store.use["disk"].served == 0
    same = LLM(model=str(tiny_model_dir), dtype="float32", **kv)  # the first's KV dtype: a hit
    (hit,) = run(same, [prompt(3)])
    assert hit.num_cached_tokens > 0 and same.llm_engine.store.use["disk"].served > 0
