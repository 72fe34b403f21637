"""fp32 compute on weights rounded to bf16: what dtype="auto" runs on a CPU without bf16
arithmetic, where the AVX2 small-batch kernel reads the weights as bf16 (half the bytes).

Its outputs are exactly a float32 engine's on a checkpoint whose weights were rounded to bf16
beforehand: the rounding is the only change, the kernels sum the same values the same way."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.platforms import cpu_has_native_bf16, get_platform
from kvserve.platforms.cpu import CpuPlatform
from kvserve.sampling_params import SamplingParams

AVX2_KERNEL = small_batch_isa(torch.float32) == "avx2"
needs_avx2_kernel = pytest.mark.skipif(not AVX2_KERNEL, reason="no AVX2 small-batch kernel")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(100, 140)), list(range(300, 309))]


def test_auto_rounds_the_weights_only_where_the_cpu_computes_in_fp32_on_the_avx2_kernel():
    auto = get_platform("cpu", "auto")
    if cpu_has_native_bf16():
        assert (auto.dtype, auto.weight_dtype) == (torch.bfloat16, torch.bfloat16)
    else:
        assert auto.dtype == torch.float32
        assert auto.weight_dtype == (torch.bfloat16 if AVX2_KERNEL else torch.float32)
    exact = get_platform("cpu", "float32")
    assert (exact.dtype, exact.weight_dtype) == (torch.float32, torch.float32)


@pytest.fixture(scope="module")
def rounded_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with every matrix rounded to bf16 values, stored as fp32."""
    out = tmp_path_factory.mktemp("tiny-rounded")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    save_file({k: v.bfloat16().float() if v.dim() == 2 else v for k, v in weights.items()}, out / "model.safetensors")
    return out


def outputs(model_dir, monkeypatch=None, platform=None) -> tuple[LLMEngine, dict[str, list[int]]]:
    if platform is not None:
        monkeypatch.setattr(
            "kvserve.engine.llm_engine.get_platform", lambda device, dtype, kv_cache_dtype="auto": platform
        )
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=256))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, str(i))
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return engine, done


@needs_avx2_kernel
def test_rounded_weights_give_a_float32_engine_on_a_rounded_checkpoint_bit_for_bit(
    tiny_model_dir, rounded_model_dir, monkeypatch
):
    rounded_engine, rounded = outputs(
        tiny_model_dir, monkeypatch, CpuPlatform(torch.device("cpu"), torch.float32, torch.bfloat16)
    )
    monkeypatch.undo()
    _, reference = outputs(rounded_model_dir)
    assert rounded == reference
    assert rounded_engine.weight_dtype == torch.bfloat16
    head = rounded_engine.runner.model.lm_head
    assert head.small.packed.dtype == torch.bfloat16  # read as bf16 by the kernel
    exact_engine, _ = outputs(tiny_model_dir)
    embed, exact_embed = (e.runner.model.embed_tokens.weight for e in (rounded_engine, exact_engine))
    assert not torch.equal(embed, exact_embed) and torch.equal(embed, exact_embed.bfloat16().float())
