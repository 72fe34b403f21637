"""BlockPool and its free queue: ref counts, eviction order, double frees."""

from __future__ import annotations

import pytest

from kvserve.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


# FreeBlockQueue


def test_queue_popleft_in_insertion_order() -> None:
    _, q = make_queue(4)
    assert [q.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert len(q) == 0


def test_queue_popleft_empty_raises() -> None:
    _, q = make_queue(0)
    with pytest.raises(IndexError):
        q.popleft()


def test_queue_append_goes_to_back() -> None:
    _, q = make_queue(3)
    first = q.popleft()
    q.append(first)
    assert ids(q) == [1, 2, 0]


def test_queue_remove_from_middle_keeps_links() -> None:
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert len(q) == 4
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None


def test_queue_remove_head_and_tail() -> None:
    blocks, q = make_queue(3)
    q.remove(blocks[0])
    q.remove(blocks[2])
    assert ids(q) == [1]
    assert q.popleft() is blocks[1]


def test_queue_remove_touches_only_neighbours() -> None:
    # O(1): removal must not walk the list, so it works the same on a long one.
    blocks, q = make_queue(10_000)
    for b in blocks[1:-1:2]:
        q.remove(b)
    assert len(q) == 5_001
    assert ids(q)[:3] == [0, 2, 4]


def test_queue_remove_block_not_in_queue_raises() -> None:
    blocks, q = make_queue(3)
    popped = q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(popped)
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(99))
    assert ids(q) == [1, 2]


def test_queue_removed_block_can_be_appended_again() -> None:
    blocks, q = make_queue(3)
    q.remove(blocks[1])
    q.append(blocks[1])
    assert ids(q) == [0, 2, 1]


# BlockPool


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_pool_get_new_blocks_sets_ref_and_counts() -> None:
    pool = BlockPool(8)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_allocations) == (5, 3, 3)
    assert pool.usage() == pytest.approx(3 / 8)
    pool.check_integrity()


def test_pool_get_too_many_raises_without_side_effects() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1 and pool.num_allocations == 3
    pool.check_integrity()


def test_pool_incr_ref_shares_and_revives_free_block() -> None:
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.incr_ref([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    pool.free_blocks([a])
    assert a.is_free
    # A free (e.g. cached) block taken back from the middle of the queue.
    pool.incr_ref([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert 2 not in ids(pool.free_queue)
    assert pool.num_allocations == 1  # sharing is not a new allocation
    pool.check_integrity()


def test_pool_free_order_is_eviction_order() -> None:
    pool = BlockPool(6)
    table = pool.get_new_blocks(3)
    pool.free_blocks(reversed(table))
    assert ids(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    pool.check_integrity()


def test_pool_shared_block_stays_used_until_last_ref() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.incr_ref([a])
    pool.free_blocks([a])
    assert pool.num_used_blocks == 1 and not a.is_free
    pool.free_blocks([a])
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_pool_double_free_raises() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_blocks([a])
    pool.check_integrity()
    assert pool.num_free_blocks == 2


def test_pool_check_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.blocks[0].ref_cnt = 1  # referenced, yet still queued
    with pytest.raises(AssertionError):
        pool.check_integrity()
