"""The dashboard's snapshot (engine/kv_state.py) accounts for every block of the pool after every step."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.engine.kv_state import EVICTABLE, FREE, capture_kv_state, tenant_digest
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.sampling_params import SamplingParams


def test_snapshot_codes_every_block_as_the_pool_counts_it(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=40, max_num_seqs=8))
    engine.add_request(list(range(500, 560)), SamplingParams(max_tokens=2, ignore_eos=True), cache_salt="s1")
    while engine.has_unfinished_requests():
        engine.step()
    shared = list(range(100, 164))
    sampled = SamplingParams(n=2, max_tokens=40, ignore_eos=True, temperature=1.0, seed=0)
    engine.add_request(shared, sampled, cache_salt="s1")  # two samples share the prompt's blocks
    engine.add_request(shared, SamplingParams(max_tokens=40, ignore_eos=True), cache_salt="s2")
    digests = {tenant_digest(extra_key(salt)) for salt in ("s1", "s2")}
    seen_shared = seen_both = False
    while engine.has_unfinished_requests():
        engine.step()
        state, pool = capture_kv_state(engine, engine.scheduler.num_waiting), engine.kv.pool
        assert len(state.blocks) == pool.num_blocks == state.num_free + state.num_evictable + state.num_used
        assert (state.num_free, state.num_evictable) == (pool.num_free_blocks, pool.num_evictable_blocks)
        assert state.num_used == pool.num_used_blocks
        for block, code in zip(pool.blocks, state.blocks, strict=True):
            assert code == (FREE if not block.cached else EVICTABLE) if block.ref_cnt == 0 else code.isalpha()
            assert code.isupper() == (block.ref_cnt > 1)
        assert sum(t.blocks for t in state.tenants) == state.num_used  # every block in use has its tenant
        assert {t.digest for t in state.tenants} <= digests  # digests only: never a salt
        assert "s1" not in repr(state) and "s2" not in repr(state)
        seen_shared |= state.num_shared > 0
        seen_both |= len(state.tenants) == 2
    assert seen_shared and seen_both
    state = capture_kv_state(engine, 0)
    assert state.num_used == 0 and state.tenants == () and state.num_evictable > 0
