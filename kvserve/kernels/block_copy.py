"""`csrc/block_copy.cpp`: whole KV blocks between a CPU pool and the tiers' bytes, and from
block to block in the pool (copy-on-write), a copy per block's layer and K/V part, blocks
spread over the threads (from Python each such copy cost as much as its bytes: 3 GB/s
where this moves 6-8 on one thread and 12-13 on two, with streaming stores)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from kvserve.kernels.build import load


class HostBlockCopy:
    """Blocks of a CPU pool: each layer's cache is [2, blocks, ...], a stored block
    [layers, 2, block bytes]."""

    def scatter(self, caches: list[torch.Tensor], payloads: Sequence[bytes | memoryview], block_ids: list[int]) -> None:
        """Payload i into block `block_ids[i]` of every layer's cache."""
        with warnings.catch_warnings():  # read-only buffers: the op only reads them
            warnings.simplefilter("ignore", UserWarning)
            tensors = [torch.frombuffer(p, dtype=torch.uint8) for p in payloads]
        load().scatter_blocks(caches, tensors, torch.tensor(block_ids, dtype=torch.long))

    def gather(self, caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
        """The blocks as stored, [n, layers * 2 * block bytes] uint8."""
        out = torch.empty((len(block_ids), 2 * len(caches) * caches[0][0, 0].nbytes), dtype=torch.uint8)
        self.gather_into(caches, block_ids, list(out))
        return out

    def gather_into(self, caches: list[torch.Tensor], block_ids: list[int], outs: Sequence[object]) -> None:
        """Block `block_ids[i]` as stored into writable buffer `outs[i]` (a block's bytes each)."""
        tensors = [o if isinstance(o, torch.Tensor) else torch.frombuffer(o, dtype=torch.uint8) for o in outs]
        load().gather_blocks(tensors, caches, torch.tensor(block_ids, dtype=torch.long))

    def copy(self, caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Block `src[i]` onto block `dst[i]` in every cache (each tensor once: `caches` distinct)."""
        load().copy_blocks(caches, torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
