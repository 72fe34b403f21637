"""Int8 keys of k_norm models in a rotated basis (`layers/attention/key_rotation.py`): the
rotation keeps every score, shrinks int8's error where gains make outlier channels, applies only
to int8 pools, and makes the records another scheme's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.layers.attention.backend import TorchAttention
from kvserve.layers.attention.key_rotation import hadamard, int8_scheme, key_rotation, rotates_keys
from kvserve.layers.attention.kv_quant import SCHEME, dequantize_kv, quantize_kv
from kvserve.layers.layer_ops import TorchLayerOps
from kvserve.layers.linear import PackedLinear
from kvserve.models.llama import Attention
from tests.test_gemma3_engine import tiny_gemma3_dir  # noqa: F401 (a fixture)


def gains(dim: int, seed: int = 0) -> torch.Tensor:
    """k_norm gains as Gemma 3's: around 2, a few channels near 30."""
    g = torch.Generator().manual_seed(seed)
    w = 2 + torch.rand(dim, generator=g)
    w[torch.randperm(dim, generator=g)[:4]] = 30.0
    return w


def normed_keys(w: torch.Tensor, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, w.shape[0], generator=g)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt() * w


@pytest.mark.parametrize("n", [1, 2, 16, 256])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h, torch.eye(n), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("n", [0, 3, 96])
def test_a_head_dim_not_a_power_of_two_keeps_its_keys_as_they_are(n):
    with pytest.raises(ValueError, match=f"got {n}"):
        hadamard(n)
    assert not rotates_keys(True, n)
    assert rotates_keys(True, 128) and not rotates_keys(False, 128)


def test_the_rotation_keeps_every_score():
    w = gains(64)
    q, k = torch.randn(8, 64), normed_keys(w, 32)
    q_matrix, k_matrix = key_rotation(gains(64, seed=2), w, torch.float32)
    torch.testing.assert_close((q @ q_matrix) @ (k @ k_matrix).T, q @ k.T, rtol=1e-4, atol=1e-4)


def test_rotated_int8_keys_score_with_a_fraction_of_the_error():
    w = gains(256)
    q, k = torch.randn(64, 256), normed_keys(w, 512)
    exact = q @ k.T
    plain = q @ dequantize_kv(quantize_kv(k)).T
    q_matrix, k_matrix = key_rotation(torch.ones(256), w, torch.float32)
    rotated = (q @ q_matrix) @ dequantize_kv(quantize_kv(k @ k_matrix)).T
    assert (rotated - exact).pow(2).mean() * 5 < (plain - exact).pow(2).mean()


def test_only_int8_pools_see_rotated_keys_and_their_records_are_another_schemes(tiny_model_dir, tiny_gemma3_dir):  # noqa: F811
    assert int8_scheme(False, 16) == int8_scheme(True, 96) == SCHEME
    assert int8_scheme(True, 16).startswith(SCHEME + "+")

    def engine(model_dir, kv_dtype):
        llm = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype=kv_dtype, num_kv_blocks=32, kv_disk_size=0)
        return llm.llm_engine

    gemma = engine(tiny_gemma3_dir, "int8")
    assert gemma.namespace.kv_quant == int8_scheme(True, 16)
    assert engine(tiny_model_dir, "int8").namespace.kv_quant == SCHEME  # Llama: no k_norm, keys as they are
    attn = gemma.runner.model.layers[0].self_attn
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    fp32_attn = engine(tiny_gemma3_dir, "float32").runner.model.layers[0].self_attn
    same_q, same_k = fp32_attn.rotate_int8_keys(q, k)  # an fp32 pool: keys as they are
    assert fp32_attn.int8_rotation is None and same_q is q and same_k is k
    assert all(isinstance(m, PackedLinear) for m in attn.int8_rotation)  # packed, as the projections are
    unpacked = Attention(gemma.model_config, TorchAttention(), TorchLayerOps())  # as on a GPU: nn.Linear
    unpacked.store_int8_keys_rotated()
    for layer in (attn, unpacked):
        rq, rk = layer.rotate_int8_keys(q, k)
        torch.testing.assert_close(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(rk, k)


def test_a_qwen3_style_llama_rotates_its_int8_keys_and_a_cache_hit_keeps_the_output(tmp_path, smollm2_dir):
    model_dir = make_tiny_checkpoint(tmp_path, smollm2_dir, model_type="qwen3", head_dim=32)
    prompt = list(range(100, 160))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def greedy(llm):
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    args = {"model": str(model_dir), "dtype": "float32", "kv_cache_dtype": "int8", "num_kv_blocks": 32}
    cold = LLM(**args, enable_prefix_caching=False, kv_disk_size=0)
    warm = LLM(**args, kv_disk_size=0)
    assert warm.llm_engine.namespace.kv_quant == int8_scheme(True, 32)
    attn = warm.llm_engine.runner.model.layers[0].self_attn
    assert attn.int8_rotation is not None
    first = greedy(warm)
    assert first == greedy(cold)
    assert greedy(warm) == first and warm.llm_engine.stats.prefix_cache_hits > 0
