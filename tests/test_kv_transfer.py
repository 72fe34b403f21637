"""KVTransfer's two ways of moving whole blocks, the kernel's copies on a CPU pool and the
staging tensor, give the stored layout [layers, 2, block_size, heads, head_dim] both ways
(the kernel streams parts of a multiple of 64 bytes and memcpys the others: both shapes),
with or without host RAM's arena to gather into."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.kv_transfer import KVTransfer, block_shape
from kvserve.kernels.block_copy import HostBlockCopy
from kvserve.kernels.build import available
from kvserve.kv_cache.kv_cache_manager import BlockLoad, BlockSave
from kvserve.kv_cache.tiers.host import HostTier
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.kv_cache.tiers.store import TieredKVStore
from kvserve.platforms import kv_dtype_name

COPIERS = [pytest.param(None, id="staged")] + [
    pytest.param(
        HostBlockCopy(), id="kernel", marks=pytest.mark.skipif(not available(), reason="CPU kernels did not build")
    )
]


BLOCK_SHAPES = [(4, 3, 16), (2, 1, 12)]  # (block_size, heads, head_dim): 384-768 and 48-96 bytes a part


def pool(
    layers: int, dtype: torch.dtype, seed: int, block_shape: tuple[int, int, int] = BLOCK_SHAPES[0]
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # int8 K/V: rows of codes and scales, moved as any bytes
        return [torch.randint(0, 256, (2, 12, *block_shape), generator=gen, dtype=dtype) for _ in range(layers)]
    return [torch.randn((2, 12, *block_shape), generator=gen).to(dtype) for _ in range(layers)]


def stored(caches: list[torch.Tensor], block: int) -> bytes:
    """A block as the tiers keep it, built the obvious way."""
    return torch.stack([c[:, block] for c in caches]).contiguous().view(torch.uint8).numpy().tobytes()


def host_store(caches: list[torch.Tensor], arena: bool, blocks: int = 64) -> TieredKVStore:
    """A store over host RAM alone (`blocks` of room), with block-sized arena slots or plain copies."""
    ns = Namespace("test", kv_dtype_name(caches[0].dtype), caches[0].shape[2], block_shape(caches))
    return TieredKVStore(ns, [HostTier(blocks * ns.block_nbytes, ns.block_nbytes if arena else 0)])


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "copies"])
@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES)
def test_blocks_out_and_back_in(copier, dtype, block_shape, arena):
    caches = pool(5, dtype, 0, block_shape)
    ids = [7, 0, 11, 3]
    gathered = KVTransfer(caches, host_store(caches, arena), copier).read(ids)
    assert [bytes(row) for row in gathered] == [stored(caches, b) for b in ids]

    target = pool(5, dtype, 1, block_shape)
    before = [c.clone() for c in target]
    transfer = KVTransfer(target, host_store(caches, arena), copier)
    transfer.load([BlockLoad(b, stored(caches, s)) for b, s in [(2, 7), (9, 0), (5, 11)]])
    for layer, (t, c, old) in enumerate(zip(target, caches, before, strict=True)):
        for dst, src in [(2, 7), (9, 0), (5, 11)]:
            assert torch.equal(t[:, dst], c[:, src]), layer
        others = [b for b in range(12) if b not in (2, 9, 5)]
        assert torch.equal(t[:, others], old[:, others]), layer


@pytest.mark.skipif(not available(), reason="CPU kernels did not build")
def test_kernel_rejects_a_short_payload_and_a_bad_block_id():
    caches = pool(2, torch.float32, 0)
    good = stored(caches, 0)
    with pytest.raises(RuntimeError, match="payload 0 has"):
        HostBlockCopy().scatter(caches, [good[:-4]], [1])
    with pytest.raises(RuntimeError, match="block id 12 out of range"):
        HostBlockCopy().scatter(caches, [good], [12])
    with pytest.raises(RuntimeError, match="block id -1 out of range"):
        HostBlockCopy().gather(caches, [-1])


@pytest.mark.skipif(not available(), reason="CPU kernels did not build")
def test_kernel_copies_blocks_within_the_pool():
    caches = pool(3, torch.bfloat16, 0)
    before = [c.clone() for c in caches]
    HostBlockCopy().copy(caches, [1, 4, 9], [0, 5, 2])
    for c, old in zip(caches, before, strict=True):
        for src, dst in [(1, 0), (4, 5), (9, 2)]:
            assert torch.equal(c[:, dst], old[:, src])
        untouched = [b for b in range(12) if b not in (0, 5, 2)]
        assert torch.equal(c[:, untouched], old[:, untouched])
    with pytest.raises(RuntimeError, match="onto itself"):
        HostBlockCopy().copy(caches, [3], [3])


@pytest.mark.skipif(not available(), reason="CPU kernels did not build")
def test_a_save_gathers_into_host_ram_slots_kept_as_they_are_and_reused_once_nothing_reads_them():
    caches = pool(3, torch.bfloat16, 0)
    store = host_store(caches, arena=True, blocks=2)
    host, transfer = store.local[0], KVTransfer(caches, store, HostBlockCopy())

    def evict(blocks: list[int]) -> list[bytes]:
        transfer.save([BlockSave(block_key=bytes([b]) * 32, block_id=b, filled=False) for b in blocks])
        return store.keys([bytes([b]) * 32 for b in blocks])

    def in_use() -> int:
        return host.arena.num_slots - host.arena.num_free

    keys = evict([4, 9])
    held = host.get(keys)  # as a load waiting to be scattered holds them
    assert [bytes(p) for p in held] == [stored(caches, 4), stored(caches, 9)]
    assert all(host.arena.owns(p.obj) for p in held)  # the buffers gathered into, not copies
    assert in_use() == 2
    evict([4, 9])  # held already: the new buffers go back
    assert in_use() == 2
    evict([1, 2])  # pushes 4 and 9 out of host RAM, while `held` still reads them
    assert host.get(keys) == [None, None] and in_use() == 4
    assert [bytes(p) for p in held] == [stored(caches, 4), stored(caches, 9)]
    del held
    assert in_use() == 2
