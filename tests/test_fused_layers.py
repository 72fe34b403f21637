"""The C++ layer loop gives exactly what the Python layers give (bf16 and fp32), on every
kind of step: decodes, short and long prefill chunks, chunks after a cached prefix, and
batches past the small-batch kernel's row limit (oneDNN); in bf16 on each kernel path the
CPU has (AMX, or the AVX512-BF16 dot products, for matmuls and prefill attention alike); in
fp32 with the fp32 prefill kernel where the host takes it (AVX2); and on K/V stored in another
form than the compute dtype (bf16 under fp32, int8 rows under either), written and read by the
kernels in both."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import kv_slots
from kvserve.kernels import build, prefill_attention
from kvserve.kernels.small_batch_linear import bf16_paths
from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.layers import linear
from kvserve.layers.attention.kv_quant import stored_head_dim

pytestmark = pytest.mark.skipif(not build.available(), reason="kvserve's CPU kernels did not build")

# an AMX machine also runs the AVX512-BF16 kernel (as a CPU without AMX would, up to 4 rows);
# fp32 runs with its AVX2 kernel where it is compiled in, and with oneDNN alone on any CPU
ISAS = bf16_paths()
FP32_ISAS = sorted({"", small_batch_isa(torch.float32)})  # oneDNN alone, and the kernel where there is one
DTYPES_AND_ISAS = [("bfloat16", isa) for isa in ISAS] + [("float32", isa) for isa in FP32_ISAS]
needs_bf16_kernel = pytest.mark.skipif(not ISAS, reason="no small-batch bf16 kernel on this CPU")

SYSTEM = "You are a terse assistant. Answer in one line, and never apologise. " * 4
PROMPTS = ["Hi", "The capital of France is", "a b c d e f g h i j k l m n o p q r s t", "word " * 100]
FOLLOW_UPS = [SYSTEM + "Q: what is two plus two, in words? A:", SYSTEM + "Q: name a colour of the sky at noon. A:"]


def generate(llm: LLM, fused: bool) -> list[tuple[list[int], list[float]]]:
    model = llm.llm_engine.runner.model
    saved = model.layer_loop
    model.layer_loop = saved if fused else None
    try:
        llm.llm_engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
        outs = llm.generate(PROMPTS + [SYSTEM], params, use_tqdm=False)
        outs += llm.generate(FOLLOW_UPS, params, use_tqdm=False)  # SYSTEM is cached by now
    finally:
        model.layer_loop = saved
    assert all(o.num_cached_tokens > 0 for o in outs[-len(FOLLOW_UPS) :])
    samples = [o.outputs[0] for o in outs]
    return [(s.token_ids, [lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs, strict=True)]) for s in samples]


@pytest.mark.parametrize(("dtype", "isa"), DTYPES_AND_ISAS)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: bias on q/k/v
def test_fused_loop_matches_python_layers_bit_for_bit(tmp_path, smollm2_dir, model_type, dtype, isa, monkeypatch):
    monkeypatch.setattr(linear, "small_batch_isa", lambda dtype: isa)
    if dtype == "bfloat16":  # prefill attention on the same path (the dot products: its tiles' twin)
        monkeypatch.setattr(prefill_attention, "isa", lambda dtype: isa)
    # 32-dim heads: the smallest the prefill kernel takes (the tiny model's 16 go to SDPA)
    model_dir = make_tiny_checkpoint(tmp_path, smollm2_dir, model_type=model_type, hidden_size=128)
    llm = LLM(model=str(model_dir), dtype=dtype, kv_cache_memory="16MiB")
    model = llm.llm_engine.runner.model
    small = model.layers[0].mlp.down_proj.small
    assert model.layer_loop is not None and (small is None) == (isa == "")
    assert small is None or small.use_amx == (isa == "amx")
    # fp32 prefill chunks take the fp32 kernel where the host's is AVX2 (the long prompt's chunk)
    prefill = isa if dtype == "bfloat16" else prefill_attention.isa(torch.float32)
    assert model.layer_loop.backend.prefill_kernel == prefill
    assert generate(llm, fused=True) == generate(llm, fused=False)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_kernel)])
def test_every_step_runs_the_loop(tiny_model_dir, dtype, monkeypatch):
    llm = LLM(model=str(tiny_model_dir), dtype=dtype, kv_cache_memory="16MiB")
    fused = llm.llm_engine.runner.model.layer_loop
    rows = []
    monkeypatch.setattr(type(fused), "__call__", lambda self, x, *a: rows.append(x.shape[0]) or [x, x])
    monkeypatch.setattr(type(llm.llm_engine.runner.model.layers[0]), "forward", lambda *a: pytest.fail("Python layers"))
    llm.generate([list(range(1000, 1100))], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert rows == [100, 1, 1]  # the prefill, then two decodes


def use_int8_pools(llm: LLM) -> None:
    """Swap the runner's pools for int8 ones (uint8 rows of codes, scale and minimum) of as many blocks."""
    runner = llm.llm_engine.runner
    pools = {
        id(c): torch.zeros(*c.shape[:-1], stored_head_dim(c.shape[-1]), dtype=torch.uint8) for c in runner.kv_tensors
    }
    runner.kv_caches = [pools[id(c)] for c in runner.kv_caches]
    runner.kv_tensors = kv_slots(runner.kv_caches)


STORED_KV = [("float32", "bfloat16"), ("float32", "int8"), pytest.param("bfloat16", "int8", marks=needs_bf16_kernel)]


@pytest.mark.parametrize(("dtype", "kv"), STORED_KV)
def test_fused_loop_on_stored_kv_matches_python_layers(tmp_path, smollm2_dir, dtype, kv):
    model_dir = make_tiny_checkpoint(tmp_path, smollm2_dir, hidden_size=128)
    llm = LLM(model=str(model_dir), dtype=dtype, kv_cache_memory="16MiB", kv_cache_dtype=kv if kv != "int8" else "auto")
    if kv == "int8":
        use_int8_pools(llm)
    assert llm.llm_engine.runner.model.layer_loop is not None
    assert llm.llm_engine.runner.kv_caches[0].dtype == (torch.uint8 if kv == "int8" else torch.bfloat16)
    assert generate(llm, fused=True) == generate(llm, fused=False)
