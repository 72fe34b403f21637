"""The handoff's body buffers: a buffer is handed out again only once every view of it is gone."""

from __future__ import annotations

from kvserve.kv_cache.tiers.pages import BufferPool


def test_a_buffer_in_use_is_never_handed_out_again_and_a_released_one_is():
    pool = BufferPool(keep=2)
    first = pool.take(1000)
    region1, record = first.obj, first[100:200]  # a block's view, as the handoff tier keeps it
    del first
    second = pool.take(1000)
    region2 = second.obj
    assert region2 is not region1  # the record still views the first mapping
    second[:4] = b"abcd"
    del second
    third = pool.take(3000)
    assert third.obj is region2 and bytes(third[:4]) == b"abcd"  # reused as it was left
    assert len(third) == 3000
    del third, record
    assert pool.take(10).obj in (region1, region2)  # both free again: no new mapping


def test_the_pool_keeps_at_most_keep_mappings_and_the_larger_ones():
    pool = BufferPool(keep=1)
    small = pool.take(10)
    small_region = small.obj
    del small
    large = pool.take(64 << 20)  # the free small mapping makes room for the larger one
    assert large.obj is not small_region and len(large) == 64 << 20
    del large
    again = pool.take(32 << 20)
    assert len(again.obj) >= 64 << 20  # the large one, reused
    extra = pool.take(10)  # the kept one is in use: a mapping of its own, not kept
    assert extra.obj is not again.obj
    assert pool.take(0).nbytes == 0
