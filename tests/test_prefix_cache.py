"""Prefix caches (RadixCache, HashChainCache) behind KVCacheManager: one behavioural suite for both.

The randomized stateful test lives in test_prefix_cache_stateful.py.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import struct
import subprocess
import sys
from collections.abc import Sequence

import pytest

from kvserve.engine.request import Request
from kvserve.kv_cache import block_keys
from kvserve.kv_cache.block_keys import chain_keys, chain_keys_hashlib
from kvserve.kv_cache.block_pool import KVCacheBlock
from kvserve.kv_cache.hash_chain_cache import HashChainCache
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, make_prefix_cache
from kvserve.kv_cache.prefix_cache import CacheSize, PrefixCache, extra_key
from kvserve.kv_cache.radix_cache import RadixCache
from kvserve.sampling_params import SamplingParams

KINDS = ["radix", "hash"]
BS = 4
_ids = itertools.count()


def make_kv(kind: str, num_blocks: int = 32, block_size: int = BS) -> KVCacheManager:
    cache = make_prefix_cache(kind, block_size)
    assert cache is not None
    return KVCacheManager(num_blocks, block_size, cache)


def cache_of(kv: KVCacheManager) -> PrefixCache:
    assert kv.prefix_cache is not None
    return kv.prefix_cache


def new_request(tokens: Sequence[int], key: bytes = b"") -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(), extra_key=key)


def admit(kv: KVCacheManager, tokens: Sequence[int], key: bytes = b"") -> Request:
    """Admit and prefill a request as the scheduler does; it keeps its blocks until freed."""
    req = new_request(tokens, key)
    hit = kv.match_prefix(req)
    assert hit is not None
    cached = hit.num_blocks * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - cached, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return req


def run(kv: KVCacheManager, tokens: Sequence[int], key: bytes = b"") -> list[KVCacheBlock]:
    """Admit, prefill and finish a request; returns the table it had."""
    req = admit(kv, tokens, key)
    table = list(kv.block_tables[req.seq_id])
    kv.free(req)
    return table


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def num_nodes(cache: PrefixCache) -> int:
    """Radix: tree nodes below the roots; hash: one entry per cached block."""
    if isinstance(cache, HashChainCache):
        return len(cache.blocks_by_hash)
    assert isinstance(cache, RadixCache)
    stack = [child for root in cache.roots.values() for child in root.children.values()]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        stack += node.children.values()
    return count


def eviction_queue(cache: PrefixCache) -> list[list[int]]:
    if isinstance(cache, HashChainCache):
        return [[b.block_id] for b in cache.evictable]
    assert isinstance(cache, RadixCache)
    return [ids(leaf.blocks) for leaf in cache.evictable_leaves]


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything a failed allocation must leave untouched."""
    cache = cache_of(kv)
    return (
        [b.ref_cnt for b in kv.pool.blocks],
        [b.cached for b in kv.pool.blocks],
        ids(list(kv.pool.free_queue)),
        {sid: ids(t) for sid, t in kv.block_tables.items()},
        set(kv.cached_prefixes),
        cache.size_info(),
        cache.num_evictable_blocks,
        eviction_queue(cache),
        kv.pool.num_allocations,
        list(kv.pending_copies),
    )


def check(kv: KVCacheManager) -> None:
    kv.pool.check_integrity()
    cache_of(kv).check_integrity()


# 1. exact and partial matches


@pytest.mark.parametrize("kind", KINDS)
def test_match_returns_the_shared_block_aligned_prefix(kind: str) -> None:
    kv = make_kv(kind)
    cache = cache_of(kv)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks cached
    owner = admit(kv, prompt)
    table = kv.block_tables[owner.seq_id]
    assert cache.size_info().cached_blocks == 2

    assert cache.match_prefix(prompt, b"").blocks == table[:2]
    assert cache.match_prefix(prompt[:6] + [0, 0, 0, 0], b"").blocks == table[:1]
    assert cache.match_prefix(prompt[:2] + [0] * 8, b"").blocks == []
    assert cache.match_prefix(prompt[:7], b"").blocks == table[:1]  # a partial block never matches
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_manager_match_leaves_the_last_token_to_compute(kind: str) -> None:
    kv = make_kv(kind)
    run(kv, range(100, 112))  # 3 full blocks
    cases = {8: 1, 9: 2, 12: 2, 13: 3, 20: 3}  # prompt length -> blocks matched
    for length, expected in cases.items():
        prompt = list(range(100, 112)) + [0] * max(0, length - 12)
        hit = kv.match_prefix(new_request(prompt[:length]))
        assert hit is not None and hit.num_blocks == expected, length


@pytest.mark.parametrize("kind", KINDS)
def test_match_changes_no_ref_count(kind: str) -> None:
    kv = make_kv(kind)
    run(kv, range(16))
    before = snapshot(kv)
    assert cache_of(kv).match_prefix(list(range(16)), b"").num_blocks == 4
    assert snapshot(kv) == before


# 2. a match ending mid-node splits it, size unchanged


@pytest.mark.parametrize("kind", KINDS)
def test_match_diverging_mid_node_splits_without_changing_size(kind: str) -> None:
    kv = make_kv(kind)
    cache = cache_of(kv)
    prompt = list(range(200, 216))
    run(kv, prompt)  # one insert of 4 blocks: a single radix node
    size, nodes = cache.size_info(), num_nodes(cache)

    hit = cache.match_prefix(prompt[:9] + [0] * 7, b"")
    assert hit.num_blocks == 2
    assert cache.size_info() == size
    assert num_nodes(cache) == nodes + (1 if kind == "radix" else 0)
    cache.match_prefix(prompt[:9] + [1] * 7, b"")  # the same cut again: nothing more to split
    assert num_nodes(cache) == nodes + (1 if kind == "radix" else 0)
    assert cache.match_prefix(prompt, b"").num_blocks == 4  # both halves still match as one prefix
    check(kv)


# 3. insert after a partial match adds only the new part


@pytest.mark.parametrize("kind", KINDS)
def test_insert_after_partial_match_adds_only_new_blocks(kind: str) -> None:
    kv = make_kv(kind)
    cache = cache_of(kv)
    first = run(kv, range(300, 316))
    cached = cache.size_info().cached_blocks

    req = admit(kv, list(range(300, 308)) + [1] * 8)
    table = kv.block_tables[req.seq_id]
    assert cache.size_info().cached_blocks == cached + 2
    assert all(a is b for a, b in zip(table[:2], first[:2], strict=True))
    assert not set(ids(table[2:])) & set(ids(first))
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_insert_returns_the_cached_block_for_a_known_prefix(kind: str) -> None:
    cache = make_prefix_cache(kind, BS)
    assert cache is not None
    tokens = list(range(8))
    mine = [KVCacheBlock(0), KVCacheBlock(1)]
    _, held = cache.insert(cache.root_handle(b""), tokens, mine, b"")
    assert held == mine and all(b.cached for b in mine)

    theirs = [KVCacheBlock(2), KVCacheBlock(3)]
    _, held = cache.insert(cache.root_handle(b""), tokens, theirs, b"")
    assert held == mine  # the first copy wins; the caller frees its duplicate
    assert not any(b.cached for b in theirs)
    assert cache.size_info().cached_blocks == 2


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_block_is_swapped_for_the_cached_one(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    first = admit(kv, range(8))  # 2 blocks cached
    # The last token is recomputed, so the second request fills a block of its own first.
    second = admit(kv, range(8))
    assert kv.block_tables[second.seq_id] == kv.block_tables[first.seq_id]
    assert [b.ref_cnt for b in kv.block_tables[first.seq_id]] == [2, 2]
    assert kv.pool.num_used_blocks == 2
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_siblings_writing_the_same_tokens_end_up_sharing_the_block(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    parent = admit(kv, range(6))  # block 1 half full
    child = new_request(range(6))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    for req in (parent, child):  # each writes tokens 6 and 7: the first writer copies the shared block
        req.append_output_token(6, None)
        req.append_output_token(7, None)
        assert kv.allocate_slots(req, 2)
        req.num_computed_tokens = 8
        kv.cache_full_blocks(req)
    assert len(kv.take_pending_copies()) == 1
    assert kv.block_tables[child.seq_id] == kv.block_tables[parent.seq_id]
    assert kv.pool.num_used_blocks == 2
    check(kv)


# 4. locked blocks are never evicted


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_in_use_are_never_evicted(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    cache = cache_of(kv)
    running = admit(kv, range(16))  # 4 blocks, held
    held = list(kv.block_tables[running.seq_id])
    run(kv, range(50, 62))  # 3 blocks, evictable
    assert (kv.pool.num_free_blocks, cache.num_evictable_blocks) == (1, 3)

    before = snapshot(kv)
    assert not kv.allocate_slots(new_request(range(90, 110)), 20)  # 5 blocks > 1 free + 3 evictable
    assert snapshot(kv) == before
    with pytest.raises(ValueError):
        kv.pool.get_new_blocks(5)
    assert snapshot(kv) == before

    assert kv.allocate_slots(new_request(range(90, 106)), 16)  # 4 blocks: evicts all 3 evictable
    assert cache.num_evictions == 3
    assert kv.block_tables[running.seq_id] == held
    assert all(b.ref_cnt == 1 and b.cached for b in held)
    assert cache.match_prefix(list(range(16)), b"").blocks == held
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_evict_takes_at_most_the_evictable_blocks(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    cache = cache_of(kv)
    admit(kv, range(8))
    run(kv, range(50, 58))
    evicted = cache.evict(100)
    assert len(evicted) == 2 and all(b.ref_cnt == 0 and not b.cached for b in evicted)
    for block in evicted:  # hand them back as the pool's reclaim does
        kv.pool.free_queue.append(block)
    assert cache.size_info() == CacheSize(cached_blocks=2, evictable_blocks=0)
    check(kv)


# 5. eviction order


def evict_one_by_one(kv: KVCacheManager) -> list[int]:
    """Once the free queue is drained, each single-block allocation evicts exactly one cached block."""
    kv.pool.get_new_blocks(kv.pool.num_free_blocks)
    order = []
    while cache_of(kv).num_evictable_blocks:
        (block,) = kv.pool.get_new_blocks(1)
        order.append(block.block_id)
    return order


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("a_first", [True, False])
def test_eviction_order_is_lru_leaves_then_shared_prefix(kind: str, a_first: bool) -> None:
    kv = make_kv(kind, num_blocks=6)
    prefix = list(range(8))  # P: 2 blocks
    ra = admit(kv, prefix + list(range(100, 108)))
    rb = admit(kv, prefix + list(range(200, 208)))
    p = ids(kv.block_tables[ra.seq_id][:2])
    a = ids(kv.block_tables[ra.seq_id][2:])
    b = ids(kv.block_tables[rb.seq_id][2:])
    assert ids(kv.block_tables[rb.seq_id][:2]) == p
    older, newer = (ra, rb) if a_first else (rb, ra)
    kv.free(older)
    kv.free(newer)
    old_tail, new_tail = (a, b) if a_first else (b, a)

    order = evict_one_by_one(kv)
    assert order == old_tail[::-1] + new_tail[::-1] + p[::-1]
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hit_refreshes_a_branch(kind: str) -> None:
    kv = make_kv(kind, num_blocks=7)
    prefix = list(range(8))
    a = ids(run(kv, prefix + list(range(100, 108))))[2:]
    b = ids(run(kv, prefix + list(range(200, 208))))[2:]
    run(kv, prefix + list(range(100, 108)) + [7])  # A used again: now B is the older one
    assert evict_one_by_one(kv)[:4] == b[::-1] + a[::-1]


# 6. a failed allocation changes nothing


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("diverge_at", [16, 10])
def test_failed_allocation_with_revived_hit_changes_nothing(kind: str, diverge_at: int) -> None:
    kv = make_kv(kind, num_blocks=8)
    cache = cache_of(kv)
    prompt = list(range(16))
    run(kv, prompt)  # 4 evictable, 4 free
    admit(kv, range(50, 62))  # holds 3: 1 free, 4 evictable
    req = new_request(prompt[:diverge_at] + [0] * (24 - diverge_at))
    size = cache.size_info()

    hit = kv.match_prefix(req)  # may split a radix node: the tree's shape, not its size
    assert hit is not None and hit.num_blocks == diverge_at // BS
    assert cache.size_info() == size
    before = snapshot(kv)
    n = req.num_tokens - hit.num_blocks * BS
    # Growing alone would fit in 1 free + 4 evictable; reviving the hit's blocks does not.
    assert kv.blocks_needed(req, n) <= kv.pool.num_available_blocks
    assert kv.blocks_needed(req, n, hit) > kv.pool.num_available_blocks
    assert not kv.allocate_slots(req, n, hit)
    assert snapshot(kv) == before
    assert req.seq_id not in kv.block_tables
    assert cache.size_info() == size
    check(kv)


@pytest.mark.parametrize("kind", KINDS)
def test_allocation_that_fits_with_revived_hit(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    prompt = list(range(16))
    first = ids(run(kv, prompt))
    admit(kv, range(50, 58))  # holds 2: 2 free, 4 evictable
    req = new_request(prompt + [0] * 4)  # hit 4 (revived), grow 1
    hit = kv.match_prefix(req)
    assert hit is not None and kv.blocks_needed(req, 4, hit) == 5
    assert kv.allocate_slots(req, 4, hit)
    assert kv.block_ids(req)[:4] == first
    assert kv.pool.num_free_blocks == 1 and cache_of(kv).num_evictable_blocks == 0
    check(kv)


# 7. salts partition the cache


SALT_PAIRS = [
    (extra_key("tenant-a"), extra_key("tenant-b")),
    (b"", extra_key("tenant-a")),
    (extra_key("tenant-a"), b""),
    (extra_key("x"), extra_key(adapter_id="x")),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("key", "other"), SALT_PAIRS)
def test_different_salts_never_match(kind: str, key: bytes, other: bytes) -> None:
    kv = make_kv(kind)
    cache = cache_of(kv)
    prompt = list(range(400, 413))
    mine = run(kv, prompt, key)
    assert cache.match_prefix(prompt, other).num_blocks == 0
    assert cache.match_prefix(prompt, key).blocks == mine[:3]

    theirs = run(kv, prompt, other)  # computed again, not shared
    assert not set(ids(theirs)) & set(ids(mine[:3]))
    assert cache.size_info().cached_blocks == 6
    assert cache.match_prefix(prompt, other).blocks == theirs[:3]
    check(kv)


# 10. reset


@pytest.mark.parametrize("kind", KINDS)
def test_reset_refused_while_blocks_are_held_and_empties_the_cache_otherwise(kind: str) -> None:
    kv = make_kv(kind, num_blocks=16)
    cache = cache_of(kv)
    run(kv, range(16))
    held = admit(kv, range(50, 62))
    size = cache.size_info()
    assert not kv.reset_prefix_cache()
    assert cache.size_info() == size

    kv.free(held)
    assert kv.reset_prefix_cache()
    assert cache.size_info() == CacheSize(cached_blocks=0, evictable_blocks=0)
    assert kv.pool.num_free_blocks == 16 and not any(b.cached for b in kv.pool.blocks)
    assert cache.match_prefix(list(range(16)), b"").num_blocks == 0
    check(kv)
    assert run(kv, range(16))  # still usable afterwards
    check(kv)


# 11. salts enter only hashed


@pytest.mark.parametrize("salt", ["tenant-a", "s3cr3t-salt-value", "x" * 64])
def test_extra_key_is_a_digest_that_hides_the_salt(salt: str) -> None:
    key = extra_key(salt)
    assert isinstance(key, bytes) and len(key) == 32
    assert salt.encode() not in key
    assert key == extra_key(salt)
    assert key != extra_key(salt + "!")
    assert extra_key() == b""


def test_extra_key_is_injective_in_salt_and_adapter() -> None:
    assert extra_key("a\x00adapter:b") != extra_key("a", "b\x00adapter:")


# preemption: a request finds its own blocks again


@pytest.mark.parametrize("kind", KINDS)
def test_preempted_request_finds_its_own_blocks(kind: str) -> None:
    kv = make_kv(kind, num_blocks=8)
    req = admit(kv, range(10))
    req.append_output_token(7, None)
    assert kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    kv.cache_full_blocks(req)
    req.append_output_token(8, None)
    req.append_output_token(9, None)  # 13 tokens, 11 computed: 2 full blocks cached
    mine = list(kv.block_tables[req.seq_id])
    kv.free(req)
    req.num_computed_tokens = 0

    hit = kv.match_prefix(req)
    assert hit is not None and hit.blocks == mine[:2]
    assert kv.allocate_slots(req, req.num_tokens - 8, hit)
    assert kv.block_tables[req.seq_id][:2] == mine[:2]
    check(kv)


# 9. radix match/insert cost does not depend on what the tree holds

BIG_BS = 16


def system_prompts() -> list[list[int]]:
    rng = random.Random(-1)
    return [[rng.randrange(50_000) for _ in range(n)] for n in (40, 64, 100)]


def conversation(i: int) -> list[list[int]]:
    """The prompts of conversation i, turn by turn (1 to 4): each extends the previous one."""
    rng = random.Random(i)
    body = [rng.randrange(50_000) for _ in range(rng.randint(64, 256))]
    turns = 1 + i % 4
    system = system_prompts()[i % 3]
    return [system + body[: len(body) * (t + 1) // turns] for t in range(turns)]


def build_conversations(count: int) -> KVCacheManager:
    kv = make_kv("radix", num_blocks=count * 24 + 64, block_size=BIG_BS)
    for i in range(count):
        for prompt in conversation(i):
            run(kv, prompt)
    return kv


def prompt_cost(kv: KVCacheManager, prompt: list[int]) -> tuple[int, int, int]:
    """Node visits of match_prefix and of inserting the computed blocks, and the blocks matched."""
    cache = cache_of(kv)
    assert isinstance(cache, RadixCache)
    req = new_request(prompt)
    start = cache.num_node_visits
    hit = kv.match_prefix(req)
    assert hit is not None
    matched = cache.num_node_visits - start
    assert kv.allocate_slots(req, req.num_tokens - hit.num_blocks * BIG_BS, hit)
    req.num_computed_tokens = req.num_tokens
    start = cache.num_node_visits
    kv.cache_full_blocks(req)
    kv.free(req)
    return matched, cache.num_node_visits - start, hit.num_blocks


@pytest.fixture(scope="module")
def conversation_trees() -> dict[int, KVCacheManager]:
    return {n: build_conversations(n) for n in (10, 1000)}


def aligned(tokens: list[int]) -> list[int]:
    return tokens[: len(tokens) // BIG_BS * BIG_BS]


def cost_prompts() -> dict[str, list[int]]:
    fresh = random.Random(10_000)
    new_turn = [fresh.randrange(50_000) for _ in range(120)]
    return {
        "new under a system prompt": system_prompts()[0] + new_turn,
        "follow-up of a 4-turn conversation": conversation(3)[-1] + new_turn,
        "block-aligned repeat": aligned(conversation(5)[-1]),
        "short": system_prompts()[2][:30],
        "nothing shared": new_turn,
    }


@pytest.mark.parametrize("name", list(cost_prompts()))
def test_radix_visits_bounded_by_prompt_blocks_not_tree_size(
    conversation_trees: dict[int, KVCacheManager], name: str
) -> None:
    prompt = cost_prompts()[name]
    costs = {n: prompt_cost(kv, prompt) for n, kv in conversation_trees.items()}
    bound = len(prompt) // BIG_BS + 1
    for matched, inserted, _ in costs.values():
        assert matched <= bound and inserted <= bound
    assert costs[10] == costs[1000]


def test_radix_visits_follow_the_path_of_a_long_conversation(conversation_trees: dict[int, KVCacheManager]) -> None:
    """Keeps the bound above honest: a deep shared path does cost one visit per node on it."""
    matched, _, blocks = prompt_cost(conversation_trees[1000], cost_prompts()["follow-up of a 4-turn conversation"])
    assert matched >= 4 and blocks >= 8
    _, inserted, _ = prompt_cost(conversation_trees[1000], cost_prompts()["block-aligned repeat"])
    assert inserted == 1  # its last block is recomputed, then found cached on insert


def test_radix_tree_holds_the_conversations(conversation_trees: dict[int, KVCacheManager]) -> None:
    kv = conversation_trees[1000]
    cache = cache_of(kv)
    assert cache.size_info().cached_blocks > 8000
    assert num_nodes(cache) > 1000
    check(kv)


# in flight: a prefix being computed in this step is shared by requests admitted in it


@pytest.mark.parametrize("kind", KINDS)
def test_request_admitted_in_the_same_step_shares_the_blocks_being_filled(kind: str) -> None:
    kv = make_kv(kind)
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    leader = new_request(prompt)
    assert kv.allocate_slots(leader, len(prompt), kv.match_prefix(leader))
    follower = new_request(prompt[:12] + [7, 8, 9])
    hit = kv.match_prefix(follower)
    assert hit is not None and hit.cached.num_blocks == 0
    assert hit.in_flight == kv.block_tables[leader.seq_id][:3]
    assert kv.allocate_slots(follower, follower.num_tokens - 12, hit)
    assert kv.pool.num_used_blocks == 5  # the leader's 4, and the follower's own last block
    other_tenant = new_request(prompt, key=extra_key("bob"))
    assert kv.match_prefix(other_tenant).num_blocks == 0
    for req in (leader, follower):  # the step ran: both are computed, their full blocks cached
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
    assert kv.block_tables[follower.seq_id][:3] == kv.block_tables[leader.seq_id][:3]
    assert not kv.in_flight and cache_of(kv).size_info().cached_blocks == 3
    kv.free(leader)
    kv.free(follower)
    check(kv)
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0 and kv.match_prefix(new_request(prompt)).cached.num_blocks == 3


@pytest.mark.parametrize("kind", KINDS)
def test_in_flight_blocks_start_after_the_cached_ones_and_leave_the_last_token(kind: str) -> None:
    kv = make_kv(kind)
    run(kv, list(range(8)))  # blocks 0-1 cached
    leader = new_request(list(range(16)) + [50])
    hit = kv.match_prefix(leader)
    assert hit.cached.num_blocks == 2 and not hit.in_flight
    assert kv.allocate_slots(leader, leader.num_tokens - 8, hit)  # fills blocks 2 and 3 this step
    twin = new_request(list(range(16)))  # its last token (in block 3) must be computed
    hit = kv.match_prefix(twin)
    assert (hit.cached.num_blocks, ids(hit.in_flight)) == (2, ids(kv.block_tables[leader.seq_id][2:3]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_freed_request_takes_its_in_flight_blocks_with_it(kind: str) -> None:
    kv = make_kv(kind)
    leader = new_request(list(range(12)))
    assert kv.allocate_slots(leader, 12, kv.match_prefix(leader))
    assert len(kv.in_flight) == 3
    kv.free(leader)  # preempted before its step ran
    assert not kv.in_flight and kv.match_prefix(new_request(list(range(13)))).num_blocks == 0


def test_block_keys_are_computed_once_per_block_and_chain_the_whole_prefix() -> None:
    kv = make_kv("radix")
    req = admit(kv, list(range(10)))
    assert req.block_keys == chain_keys(b"", list(range(8)), BS, b"")
    first = list(req.block_keys)
    for t in range(10, 17):  # decode to 17 tokens: one more full block, keys extended, not recomputed
        req.append_output_token(t, None)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
    assert req.block_keys[:2] == first and len(req.block_keys) == 4
    assert req.block_keys == chain_keys(b"", list(range(16)), BS, b"")
    assert chain_keys(b"", list(range(8)), BS, extra_key("alice")) != first  # the salt is in every key


def test_block_keys_are_the_same_in_another_process() -> None:
    code = (
        "from kvserve.kv_cache.block_keys import chain_keys; from kvserve.kv_cache.prefix_cache import extra_key;"
        "print([k.hex() for k in chain_keys(b'', list(range(40)), 16, extra_key('t'))])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == str([k.hex() for k in chain_keys(b"", list(range(40)), 16, extra_key("t"))])


@pytest.mark.parametrize("chain", [chain_keys, chain_keys_hashlib], ids=["c", "hashlib"])
def test_block_keys_are_sha256_of_parent_extra_key_and_little_endian_int64_tokens(chain) -> None:
    """The definition other processes and stored tiers rely on: any change must bump the format version."""
    tokens = [0, 1, 2**40, 49151, 7, 8, 9, 10, 11]  # one id past 32 bits
    parent, expected = b"", []
    for i in range(0, 8, 4):
        block = b"".join(t.to_bytes(8, "little") for t in tokens[i : i + 4])
        parent = hashlib.sha256(parent + b"extra" + block).digest()
        expected.append(parent)
    assert chain(b"", tokens, 4, b"extra") == expected


def test_block_keys_come_from_the_c_loop_with_the_same_keys_as_hashlib() -> None:
    """`make` builds the C loop (setup.py); without it a router misses its 1 ms decision budget."""
    from kvserve.kv_cache import _block_keys  # fails here if the extension did not build

    assert block_keys.chain_keys is _block_keys.chain_keys
    rng = random.Random(0)
    for block_size in (1, 3, 16, 256):
        tokens = [rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(4 * block_size))]
        parent, extra = rng.randbytes(rng.choice((0, 32))), rng.randbytes(rng.choice((0, 32, 45)))
        for seq in (tokens, tuple(tokens)):
            assert chain_keys(parent, seq, block_size, extra) == chain_keys_hashlib(parent, seq, block_size, extra)


@pytest.mark.parametrize("chain", [chain_keys, chain_keys_hashlib], ids=["c", "hashlib"])
def test_block_keys_refuse_bad_input_by_name(chain) -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        chain(b"", [1, 2], 0, b"")
    for tokens in ([1, "2"], [1, 2, 3, "4"]):  # the second: after a key is made
        with pytest.raises((TypeError, struct.error)):  # struct.error from hashlib's packing, TypeError from C
            chain(b"", tokens, 2, b"")
