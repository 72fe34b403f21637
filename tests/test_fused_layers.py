"""The C++ layer loop (decode steps, bf16) gives exactly what the Python layers give."""

from __future__ import annotations

import pytest
from conftest import make_tiny_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.model.packed_linear import small_batch_isa

pytestmark = pytest.mark.skipif(not small_batch_isa(), reason="no small-batch bf16 kernel on this CPU")

PROMPTS = ["Hi", "The capital of France is", "def fibonacci(n):" * 3, "a b c d e f g h i j k l m n o p q r s t"]


def generate(llm: LLM, fused: bool) -> list[tuple[list[int], list[float]]]:
    model = llm.llm_engine.runner.model
    saved = model.fused_layers
    model.fused_layers = saved if fused else None
    try:
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        model.fused_layers = saved
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)],
        )
        for o in outs
    ]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: bias on q/k/v
def test_fused_loop_matches_python_layers_bit_for_bit(tmp_path, smollm2_dir, model_type):
    model_dir = make_tiny_checkpoint(tmp_path, smollm2_dir, model_type=model_type)
    llm = LLM(model=str(model_dir), dtype="bfloat16", kv_cache_memory="16MiB", enable_prefix_caching=False)
    assert llm.llm_engine.runner.model.fused_layers is not None
    assert generate(llm, fused=True) == generate(llm, fused=False)


def test_fused_loop_takes_only_the_steps_it_has_kernels_for(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="16MiB")
    fused = llm.llm_engine.runner.model.fused_layers
    calls = []
    original = fused.op
    fused.op = lambda *args: calls.append(args[0].shape[0]) or original(*args)
    llm.generate(["word " * 100], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert calls == [1, 1]  # the 100-token prefill ran the Python layers, the two decodes the loop


def test_float32_models_keep_the_python_layers(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB")
    assert llm.llm_engine.runner.model.fused_layers is None
