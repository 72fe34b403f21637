"""int8 K/V (`--kv-cache-dtype int8`): asymmetric uint8 per (token, KV head), scale and minimum
stored after each row's codes (`layers/attention/kv_quant.py`).

The scheme's round trip and layout; TorchAttention on an int8 pool against the float path on the
dequantized values (blocks of 1 to 16 tokens, GQA, a sliding window); and in the engine, every
way a prefix can arrive (the prefix cache, host RAM, disk, Redis, a prefill replica, a recompute
after preemption, a fork) gives exactly the output of the same prompt computed cold, because
blocks move as the bytes they are stored as. A tier record of one KV dtype is a miss for another.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import replica_info
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.kv_cache.tiers.record import BadRecord, decode, encode
from kvserve.layers.attention import kv_quant
from kvserve.layers.attention.backend import TorchAttention
from kvserve.layers.attention.kv_quant import dequantize_kv, quantize_kv
from kvserve.platforms import get_platform
from kvserve.sampling_params import BeamSearchParams
from tests.test_cpu_attention import make_batch
from tests.test_gemma3_engine import tiny_gemma3_dir  # noqa: F401 (a fixture)
from tests.test_kv_tiers_engine import run
from tests.test_server_common import TINY_ARGS, ServerThread, wait_idle, write_keys

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KV_DTYPES = ("float32", "bfloat16", "int8")


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


# --- the scheme --------------------------------------------------------------------------


def rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Rows with an offset and outliers, as K after rotary has: asymmetry matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * 3 + torch.randn(n, 1, generator=g) * 5
    x[:, 0] += 40
    return x


@pytest.mark.parametrize("dim", [16, 64, 256])
def test_round_trip_is_within_half_a_step(dim):
    x = rows(257, dim)
    q = quantize_kv(x)
    assert q.dtype == torch.uint8 and q.shape == (257, kv_quant.stored_head_dim(dim)) == (257, dim + 8)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 255
    err = (dequantize_kv(q) - x).abs()
    assert (err <= step / 2 + 1e-5 * hi.abs().clamp_min(1)).all()
    # the extremes are exact codes: the minimum 0, the maximum 255
    assert (q[:, :dim].amin(-1) == 0).all() and (q[:, :dim].amax(-1) == 255).all()
    assert dequantize_kv(q, torch.bfloat16).dtype == torch.bfloat16


def test_the_stored_row_is_codes_then_fp32_scale_and_minimum():
    x = rows(3, 16, seed=1)
    q = quantize_kv(x)
    tail = q[:, 16:].contiguous().view(torch.float32)  # [3, 2]
    lo, hi = x.amin(-1), x.amax(-1)
    assert torch.equal(tail[:, 1], lo) and torch.equal(tail[:, 0], (hi - lo) / 255)
    codes = torch.round((x - lo[:, None]) * (255 / (hi - lo))[:, None]).clamp(0, 255)
    assert torch.equal(q[:, :16], codes.to(torch.uint8))


def test_a_constant_row_comes_back_exactly():
    x = torch.full((2, 4, 32), -1.25)
    q = quantize_kv(x)
    assert (q[..., :32] == 0).all() and torch.equal(dequantize_kv(q), x)


def test_int8_resolves_to_a_uint8_pool_the_kernels_read_where_built():
    from kvserve.kernels.build import available

    platform = get_platform("cpu", "float32", "int8")
    assert platform.kv_dtype == torch.uint8
    assert isinstance(platform.attention_backend(64), TorchAttention) is not available()


# --- TorchAttention on an int8 pool -----------------------------------------------------------


def paged_batch(bs: int, decode_lens, prefills, heads: int, kv_heads: int, dim: int, window=None, seed=0):
    """q/k/v, an int8 pool of random history (blocks in random order) and the float pool holding
    its dequantized values, and the metadata; prefills are (cached prefix, new tokens)."""
    q, k, v, pool, meta = make_batch(decode_lens, prefills, heads, kv_heads, dim, torch.float32, seed, bs, window)
    pool8 = quantize_kv(pool * 2 + 1)
    return q, k, v, pool8, dequantize_kv(pool8), meta


CASES = [([1, 5, 17, 40], []), ([], [(0, 23)]), ([], [(19, 6)]), ([3, 33], [(0, 9), (21, 1), (8, 30)])]


@pytest.mark.parametrize("bs", [1, 2, 3, 7, 8, 15, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("window", [None, 8])
def test_torch_attention_on_int8_is_the_float_path_on_the_dequantized_kv(bs, heads, kv_heads, case, window):
    q, k, v, pool8, pool_ref, meta = paged_batch(bs, *CASES[case], heads, kv_heads, 16, window, seed=bs)
    out = TorchAttention().forward(q, k, v, pool8, meta)
    # the reference: a float pool of the dequantized values, new K/V given as their stored values
    k_ref, v_ref = dequantize_kv(quantize_kv(k)), dequantize_kv(quantize_kv(v))
    ref = TorchAttention().forward(q, k_ref, v_ref, pool_ref, meta)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # the pool holds the new tokens' rows as quantize_kv writes them
    stored = pool8.view(2, -1, kv_heads, 24)[:, meta.slot_mapping]
    assert torch.equal(stored[0], quantize_kv(k)) and torch.equal(stored[1], quantize_kv(v))
    # and int8 is close to attention over the unquantized new K/V and history
    exact = TorchAttention().forward(q, k, v, pool_ref.clone(), meta)
    torch.testing.assert_close(out, exact, rtol=0, atol=0.1)


# --- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_tiny_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama with its LM head scaled: greedy choices far apart, so a different batch
    shape (preemption, forks) cannot swap them by rounding."""
    path = tmp_path_factory.mktemp("sharp-tiny-int8")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] *= 30.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def int8(model_dir: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_disk_size", 0)
    kwargs.setdefault("num_kv_blocks", 16)
    kwargs.setdefault("kv_cache_dtype", "int8")
    return LLM(model=str(model_dir), dtype="float32", block_size=BLOCK, **kwargs)


def tokens(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in run(llm, prompts, params=params)]


@pytest.fixture(scope="module")
def cold(tiny_model_dir) -> dict[int, list[int]]:
    """int8 outputs with no cache at all."""
    llm = int8(tiny_model_dir, enable_prefix_caching=False)
    return {seed: tokens(llm, [prompt(seed)])[0] for seed in (1, 2)}


def test_the_pool_the_log_and_server_info_count_the_scales(tiny_model_dir):
    engine = int8(tiny_model_dir, kv_cache_memory="1MiB", num_kv_blocks=None).llm_engine
    fp32 = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB").llm_engine
    cache = engine.runner.kv_caches[0]
    assert cache.dtype == torch.uint8 and cache.shape[-1] == 16 + 8  # the tiny model's head_dim is 16
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * (16 + 8)  # K/V x layers x KV heads x row
    assert engine.kv_bytes_per_token == cache[:, 0, 0].nbytes * len(engine.runner.kv_caches)
    assert engine.kv.pool.num_blocks == 2**20 // (engine.kv_bytes_per_token * BLOCK)
    assert engine.kv.pool.num_blocks > 2.5 * fp32.kv.pool.num_blocks  # 512 / 192 bytes at head_dim 16
    info = replica_info(engine)  # what /server_info reports
    assert (info.kv_cache_dtype, info.kv_bytes_per_token) == ("int8", engine.kv_bytes_per_token)
    assert info.kv_capacity_tokens == engine.kv.pool.num_blocks * BLOCK
    ns = engine.namespace
    assert (ns.kv_dtype, ns.kv_quant, ns.block_shape[-1]) == ("int8", kv_quant.SCHEME, 24)
    assert ns.block_nbytes == BLOCK * engine.kv_bytes_per_token


def test_a_prefix_cache_hit_gives_the_cold_output(tiny_model_dir, cold):
    llm = int8(tiny_model_dir, num_kv_blocks=64)
    assert tokens(llm, [prompt(1)]) == [cold[1]]
    (hit,) = run(llm, [prompt(1)])
    assert hit.num_cached_tokens == 96 and list(hit.outputs[0].token_ids) == cold[1]
    turn = prompt(1) + cold[1] + prompt(3, 20)  # the next turn: its history from the cache
    (warm,) = run(llm, [turn])
    assert warm.num_cached_tokens == 96
    assert list(warm.outputs[0].token_ids) == tokens(int8(tiny_model_dir, enable_prefix_caching=False), [turn])[0]


def tier_kwargs(tier: str, tmp_path: Path, redis_server) -> dict:
    if tier == "host":
        return {"kv_host_memory": "64MiB"}
    if tier == "disk":
        return {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB"}
    return {"kv_remote": redis_server.url()}


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_a_prefix_from_a_tier_gives_the_cold_output(tiny_model_dir, tmp_path, request, cold, tier):
    redis_server = request.getfixturevalue("redis_server") if tier == "redis" else None
    llm = int8(tiny_model_dir, **tier_kwargs(tier, tmp_path, redis_server))
    assert tokens(llm, [prompt(1)]) == [cold[1]]
    run(llm, [prompt(1000 + i) for i in range(3)])  # fills the 16-block pool: prompt 1 leaves it
    llm.llm_engine.store.flush()
    before = llm.llm_engine.store.use[tier].served
    (again,) = run(llm, [prompt(1)])
    assert again.num_cached_tokens == 96 and list(again.outputs[0].token_ids) == cold[1]
    assert llm.llm_engine.store.use[tier].served > before, f"nothing came from the {tier} tier"
    llm.llm_engine.shutdown()


def test_namespaces_of_the_kv_dtypes_are_disjoint_and_old_keys_stay():
    shapes = {"float32": 16, "bfloat16": 16, "int8": 24}
    spaces = {
        kv: Namespace("m", kv, BLOCK, (2, 2, BLOCK, 2, shapes[kv]), kv_quant=kv_quant.SCHEME if kv == "int8" else None)
        for kv in KV_DTYPES
    }
    payloads = {kv: bytes(ns.block_nbytes) for kv, ns in spaces.items()}
    for a in KV_DTYPES:
        record = encode(spaces[a], b"k" * 32, payloads[a])
        assert bytes(decode(spaces[a], b"k" * 32, record)) == payloads[a]
        for b in set(KV_DTYPES) - {a}:
            with pytest.raises(BadRecord):
                decode(spaces[b], b"k" * 32, record)
    # another scheme of int8 is another namespace; no scheme keeps the digest records had before it
    other = Namespace("m", "int8", BLOCK, (2, 2, BLOCK, 2, 24), kv_quant="sym-u8")
    assert other.digest != spaces["int8"].digest
    plain = Namespace("m", "float32", BLOCK, (2, 2, BLOCK, 2, 16))
    fields = {k: v for k, v in asdict(plain).items() if k not in ("compute_dtype", "kv_quant")}
    assert plain.digest == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def test_a_disk_record_of_one_kv_dtype_is_a_miss_for_the_others(tiny_model_dir, tmp_path):
    kv = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB"}
    for writer in KV_DTYPES:  # each writes its blocks of the same prompt beside the others'
        first = int8(tiny_model_dir, kv_cache_dtype=writer, **kv)
        run(first, [prompt(5 + KV_DTYPES.index(writer))])
        first.llm_engine.shutdown()  # write-back: what the pool caches goes to disk
    for writer in KV_DTYPES:
        for reader in KV_DTYPES:
            llm = int8(tiny_model_dir, kv_cache_dtype=reader, **kv)
            (out,) = run(llm, [prompt(5 + KV_DTYPES.index(writer))])
            hits = llm.llm_engine.store.use["disk"].served
            assert (out.num_cached_tokens > 0, hits > 0) == ((writer == reader),) * 2, (writer, reader)


def test_preemption_keeps_the_outputs(sharp_tiny_dir):
    prompts = [prompt(20 + i, 40 + 23 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [tokens(int8(sharp_tiny_dir, num_kv_blocks=64), [p], params)[0] for p in prompts]
    tight = int8(sharp_tiny_dir, num_kv_blocks=20)  # 320 slots for ~1,000: preemption is forced
    assert tokens(tight, prompts, params) == alone
    assert tight.llm_engine.stats.num_preemptions > 0
    assert tight.llm_engine.kv.pool.num_used_blocks == 0


def test_n_samples_and_beams_fork_int8_blocks(sharp_tiny_dir):
    p = prompt(30, 37)  # the last block partly filled: forks share it until a write copies it
    roomy = int8(sharp_tiny_dir, num_kv_blocks=64, enable_prefix_caching=False)
    (one,) = tokens(roomy, [p])
    (three,) = run(int8(sharp_tiny_dir, num_kv_blocks=64), [p], params=SamplingParams(temperature=0, n=3, max_tokens=8))
    assert [list(c.token_ids) for c in three.outputs] == [one] * 3
    beams = BeamSearchParams(4, 24)
    want = roomy.generate([p], [beams], use_tqdm=False)[0]
    for config in ({"prefix_cache": "radix"}, {"num_kv_blocks": 12, "enable_prefix_caching": False}):
        llm = int8(sharp_tiny_dir, **config)
        got = llm.generate([p] * 3, [beams] * 3, use_tqdm=False)  # a hit, or groups preempted
        for out in got:
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        stats = llm.llm_engine.stats
        assert stats.num_preemptions > 0 if "num_kv_blocks" in config else stats.prefix_cache_hits > 0
        assert llm.llm_engine.kv.pool.num_used_blocks == 0


def test_gemma3_window_layers_in_int8_give_the_cold_output(tiny_gemma3_dir):  # noqa: F811
    history = prompt(40, 70)  # past the 16-token window many times
    turn = history + prompt(41, 9)
    cold = int8(tiny_gemma3_dir, num_kv_blocks=64, enable_prefix_caching=False)
    llm = int8(tiny_gemma3_dir, num_kv_blocks=64)
    assert llm.llm_engine.kv_config.num_groups > 1  # window groups of their own
    assert tokens(llm, [history]) == tokens(cold, [history])
    (hit,) = run(llm, [turn])
    assert hit.num_cached_tokens > 0
    assert list(hit.outputs[0].token_ids) == tokens(cold, [turn])[0]


# --- prefill/decode ---------------------------------------------------------------------------


def test_a_prompt_through_a_prefill_replica_gives_the_cold_output(tiny_model_dir, tmp_path):
    keys = write_keys(tmp_path / "keys.txt")
    args = [*TINY_ARGS, "--kv-cache-dtype", "int8", "--cache-secret", "s", "--api-keys", str(keys)]
    auth = {"Authorization": "Bearer key-a"}
    fp32_args = [arg if arg != "int8" else "float32" for arg in args]
    with (
        ServerThread(tiny_model_dir, *args) as single,
        ServerThread(tiny_model_dir, *args, "--role", "prefill") as prefill,
        ServerThread(tiny_model_dir, *args, "--role", "decode") as decode,
        ServerThread(tiny_model_dir, *fp32_args, "--role", "decode") as fp32_decode,
    ):
        assert httpx.get(f"{decode.url}/server_info").json()["kv_cache_dtype"] == "int8"
        for n in (BLOCK + 3, 5 * BLOCK + 7):
            body = {"prompt": prompt(50 + n, n), "max_tokens": 10, "temperature": 0}
            want = httpx.post(f"{single.url}/v1/completions", json=body, headers=auth, timeout=60).json()
            handoff = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            r = httpx.post(f"{prefill.url}/v1/completions", json=handoff, headers=auth, timeout=60)
            params = r.json()["kv_transfer_params"]
            assert params["remote_block_ids"]
            body_decode = {**body, "kv_transfer_params": params}
            got = httpx.post(f"{decode.url}/v1/completions", json=body_decode, headers=auth, timeout=60).json()
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            usage = got["usage"]
            assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] <= BLOCK
            # a decode replica of another KV dtype finds no block it can use: it computes the prompt
            params = httpx.post(f"{prefill.url}/v1/completions", json=handoff, headers=auth, timeout=60).json()
            body_other = {**body, "kv_transfer_params": params["kv_transfer_params"]}
            other = httpx.post(f"{fp32_decode.url}/v1/completions", json=body_other, headers=auth, timeout=60)
            assert other.status_code == 200 and other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for server in (prefill, decode, fp32_decode):
            wait_idle(server.url)
            assert server.engine.engine.kv.pool.num_used_blocks == 0
