"""The KV tiers under a real engine (tiny random Llama, float32): blocks evicted from a small
device pool come back from host RAM, disk or a real Redis with bit-identical greedy outputs;
tenants never share; faults are misses; a restart and a second engine find what was stored.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine import scheduler
from kvserve.engine.request import RequestStatus

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LEN = 100  # 6 whole blocks reusable: the last prompt token is always computed
REUSABLE = (PROMPT_LEN - 1) // BLOCK * BLOCK


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def make(model_dir: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_disk_size", 0)
    kwargs.setdefault("num_kv_blocks", 16)
    return LLM(model=str(model_dir), dtype="float32", block_size=BLOCK, **kwargs)


def run(llm: LLM, prompts: list[list[int]], salt: str | None = None, params: SamplingParams = GREEDY):
    engine = llm.llm_engine
    ids = [engine.add_request(p, params, cache_salt=salt) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def evict_everything(llm: LLM, salt: str | None = None) -> None:
    """Fill the small pool with other prompts, so every cached block of earlier ones leaves it."""
    run(llm, [prompt(1000 + i) for i in range(3)], salt)
    llm.llm_engine.store.flush()


def served(llm: LLM, tier: str) -> int:
    return llm.llm_engine.store.use[tier].served


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[int, list[int]]:
    """Outputs with no cache at all: what every tiered run must reproduce exactly."""
    llm = make(tiny_model_dir, enable_prefix_caching=False)
    return {seed: run(llm, [prompt(seed)])[0].outputs[0].token_ids for seed in (1, 2, 3)}


def tier_kwargs(tier: str, tmp_path: Path, redis_url: str | None) -> dict:
    if tier == "host":
        return {"kv_host_memory": "64MiB"}
    if tier == "disk":
        return {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB"}
    return {"kv_remote": redis_url}


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_a_prefix_evicted_to_a_tier_comes_back_bit_identical(
    tiny_model_dir, tmp_path, redis_server, reference, tier, cache
):
    llm = make(tiny_model_dir, prefix_cache=cache, **tier_kwargs(tier, tmp_path, redis_server.url()))
    (first,) = run(llm, [prompt(1)])
    evict_everything(llm)
    before = served(llm, tier)
    (again,) = run(llm, [prompt(1)])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reference[1]
    assert again.num_cached_tokens == REUSABLE
    assert served(llm, tier) > before, f"nothing came from the {tier} tier"
    stats = llm.llm_engine.stats
    assert stats.external_prefix_cache_hits > 0 and stats.external_prefix_cache_hits % BLOCK == 0
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_another_tenant_gets_nothing_from_a_tier(tiny_model_dir, tmp_path, redis_server, reference, tier):
    llm = make(tiny_model_dir, **tier_kwargs(tier, tmp_path, redis_server.url()))
    run(llm, [prompt(2)], salt="tenant-a")
    evict_everything(llm, salt="tenant-a")
    before = served(llm, tier)
    (other,) = run(llm, [prompt(2)], salt="tenant-b")
    assert other.num_cached_tokens == 0 and served(llm, tier) == before
    assert other.outputs[0].token_ids == reference[2]
    evict_everything(llm, salt="tenant-b")
    (same,) = run(llm, [prompt(2)], salt="tenant-a")
    assert same.num_cached_tokens == REUSABLE and served(llm, tier) > before
    llm.llm_engine.shutdown()


def test_a_restarted_engine_serves_the_next_turn_from_disk(tiny_model_dir, tmp_path):
    kv = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": "64MiB"}
    first = make(tiny_model_dir, **kv)
    (turn1,) = run(first, [prompt(3)])
    first.llm_engine.shutdown()  # write-back: what the pool still caches goes to disk now
    history = prompt(3) + list(turn1.outputs[0].token_ids)
    turn2 = history + prompt(4, 20)

    restarted = make(tiny_model_dir, **kv)
    (out,) = run(restarted, [turn2])
    cold = make(tiny_model_dir, enable_prefix_caching=False)
    (expected,) = run(cold, [turn2])
    assert out.num_cached_tokens == (len(history) - 1) // BLOCK * BLOCK  # the last output token was never computed
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert served(restarted, "disk") == out.num_cached_tokens // BLOCK


def test_corrupt_disk_records_are_misses_with_correct_output(tiny_model_dir, tmp_path, reference):
    llm = make(tiny_model_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_size="64MiB")
    run(llm, [prompt(1)])
    evict_everything(llm)
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert files
    for i, f in enumerate(files):  # flip a byte in some, cut the others short
        data = bytearray(f.read_bytes())
        if i % 2:
            data[-7] ^= 0x40
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))
    (again,) = run(llm, [prompt(1)])
    assert again.outputs[0].token_ids == reference[1]
    assert again.num_cached_tokens == 0
    assert llm.llm_engine.store.tiers[0].stats.errors["corrupt"] >= 1
    llm.llm_engine.check_invariants and llm.llm_engine.kv.check_integrity()


def test_two_engines_share_a_prefix_through_redis_per_tenant(tiny_model_dir, redis_server, reference):
    writer = make(tiny_model_dir, kv_remote=redis_server.url())
    run(writer, [prompt(2)], salt="tenant-a")  # written to Redis as its blocks fill
    writer.llm_engine.store.flush()
    reader = make(tiny_model_dir, kv_remote=redis_server.url())
    (other,) = run(reader, [prompt(2)], salt="tenant-b")
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == reference[2]
    (same,) = run(reader, [prompt(2)], salt="tenant-a")
    assert same.num_cached_tokens == REUSABLE and served(reader, "redis") == REUSABLE // BLOCK
    assert same.outputs[0].token_ids == reference[2]


def test_two_engines_share_a_prefix_through_a_redis_cluster_spread_over_its_shards(
    tiny_model_dir, redis_cluster, reference
):
    url = redis_cluster.url(seeds=1)
    writer = make(tiny_model_dir, kv_remote=url)
    run(writer, [prompt(3)], salt="tenant-a")
    writer.llm_engine.store.flush()
    held = [len(redis_cluster.keys(i)) for i in range(3)]
    assert sum(held) == PROMPT_LEN // BLOCK and sum(n > 0 for n in held) > 1, held  # one prompt, several shards
    reader = make(tiny_model_dir, kv_remote=url)
    (other,) = run(reader, [prompt(3)], salt="tenant-b")
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == reference[3]
    (same,) = run(reader, [prompt(3)], salt="tenant-a")
    assert same.num_cached_tokens == REUSABLE and served(reader, "redis-cluster") == REUSABLE // BLOCK
    assert same.outputs[0].token_ids == reference[3]


def test_redis_killed_mid_run_every_request_completes_then_hits_resume(tiny_model_dir, redis_server):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = prompt(5, 64)
    prompts = [shared + prompt(100 + i, 20) for i in range(32)]
    cold = make(tiny_model_dir, enable_prefix_caching=False, num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in run(cold, prompts, params=params)]

    llm = make(tiny_model_dir, kv_remote=redis_server.url(), num_kv_blocks=64, max_num_seqs=4)
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p in prompts]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 3:
            redis_server.kill()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    redis = engine.store.tiers[0]
    assert sum(redis.stats.errors.values()) > 0 and not redis.available

    redis_server.restart()
    deadline = time.monotonic() + 40
    seed = 200
    while not redis.available and time.monotonic() < deadline:  # a new prompt's lookup is the breaker's probe
        run(llm, [prompt(seed, 20)], params=params)
        seed += 1
        time.sleep(0.2)
    assert redis.available
    run(llm, [prompt(6, 40)], params=params)  # stored again now that Redis is back
    engine.store.flush()
    reader = make(tiny_model_dir, kv_remote=redis_server.url())
    (hit,) = run(reader, [prompt(6, 40)], params=params)
    assert hit.num_cached_tokens == 32


def test_a_request_waits_for_its_load_while_others_run(tiny_model_dir, redis_server):
    """A Redis load makes its request wait (not the engine); aborting it then frees everything."""
    writer = make(tiny_model_dir, kv_remote=redis_server.url())
    run(writer, [prompt(7)])
    writer.llm_engine.store.flush()
    llm = make(tiny_model_dir, kv_remote=redis_server.url())
    engine = llm.llm_engine
    engine.add_request(prompt(8), GREEDY, request_id="other")
    # "other" runs once its lookup in Redis has found nothing; on a busy host that
    # lookup can outlast the scheduler's wait, so it may take more than one step (and
    # never more than the store's 2 s load timeout).
    deadline = time.monotonic() + 10.0
    while not engine.scheduler.running and time.monotonic() < deadline:
        engine.step()
    assert not engine.scheduler.loading
    redis_server.pause()  # the next load cannot finish until resumed
    engine.add_request(prompt(7), GREEDY, request_id="loads")
    engine.step()
    (waiting,) = engine.scheduler.loading
    assert waiting.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert any(r.request_id == "other" for r in engine.scheduler.running)
    engine.abort_request("loads")
    redis_server.resume()
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.loads


def test_a_quick_load_joins_the_step_it_started_in(tiny_model_dir, tmp_path, monkeypatch):
    """A disk load that ends within the scheduler's wait is computed in this step, not the next."""
    monkeypatch.setattr(scheduler, "LOAD_WAIT_MAX", 5.0)
    monkeypatch.setattr(scheduler, "LOAD_WAIT_SHARE", 1e6)  # the wait is LOAD_WAIT_MAX, whatever the step
    llm = make(tiny_model_dir, **tier_kwargs("disk", tmp_path, None))
    run(llm, [prompt(1)])
    evict_everything(llm)
    engine = llm.llm_engine
    engine.add_request(prompt(1), GREEDY, request_id="again")
    engine.step()
    assert not engine.scheduler.loading
    (req,) = engine.scheduler.running
    assert req.num_computed_tokens == PROMPT_LEN and served(llm, "disk") == REUSABLE // BLOCK
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.check_integrity()


def test_a_tier_smaller_than_one_block_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_host_memory=1024 bytes holds no KV block"):
        make(tiny_model_dir, kv_host_memory="1KiB")
