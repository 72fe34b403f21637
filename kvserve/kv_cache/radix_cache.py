"""RadixAttention (SGLang): a radix tree of token ids at block granularity.

Each node holds a run of whole blocks and the tokens they hold; children are
found by the tokens of their first block, so matching costs O(prompt length)
whatever the tree holds. A match that ends inside a node splits it. A node is in
use while its blocks are referenced (a running request holds every node on its
path, so ancestors of a locked node are locked too); only unreferenced leaves
are evictable, least recently released first, and a parent left childless by an
eviction becomes a candidate in turn. The evictable leaves live in a sorted list
kept up to date as the tree changes, so eviction never scans the tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from kvserve.kv_cache.block_pool import KVCacheBlock
from kvserve.kv_cache.prefix_cache import CacheSize, PrefixCache, PrefixMatch

_node_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    tokens: list[int]  # len == len(blocks) * block_size
    blocks: list[KVCacheBlock]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0
    node_id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def in_use(self) -> bool:
        """All blocks of a node have the same holders, so the first one speaks for all."""
        return self.is_root or self.blocks[0].ref_cnt > 0


class RadixCache(PrefixCache):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.roots: dict[bytes, RadixNode] = {}  # one tree per extra key (tenant salt, adapter)
        self.node_of: dict[int, RadixNode] = {}  # block id -> node holding it
        self.evictable_leaves = SortedKeyList(key=lambda n: (n.last_access, n.node_id))
        self._num_evictable = 0
        self._clock = itertools.count(1)
        self.num_node_visits = 0  # match/insert cost, counted for tests

    def _root(self, extra_key: bytes) -> RadixNode:
        if extra_key not in self.roots:
            self.roots[extra_key] = RadixNode([], [], None)
        return self.roots[extra_key]

    def _block_key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _common_blocks(self, node: RadixNode, tokens: Sequence[int], start: int) -> int:
        """How many of node's blocks equal the blocks of `tokens` from block `start` on."""
        bs, n = self.block_size, 0
        while n < len(node.blocks) and (start + n + 1) * bs <= len(tokens):
            if node.tokens[n * bs : (n + 1) * bs] != list(tokens[(start + n) * bs : (start + n + 1) * bs]):
                break
            n += 1
        return n

    def _walk(self, node: RadixNode, tokens: Sequence[int], start: int) -> tuple[RadixNode, int, list[KVCacheBlock]]:
        """Follow `tokens` (from block `start`) down from `node`, splitting where a match ends mid-node."""
        blocks: list[KVCacheBlock] = []
        i = start
        while (i + 1) * self.block_size <= len(tokens):
            child = node.children.get(self._block_key(tokens, i))
            if child is None:
                break
            self.num_node_visits += 1
            k = self._common_blocks(child, tokens, i)
            if k < len(child.blocks):
                child = self._split(child, k)
            blocks += child.blocks
            i += k
            node = child
        return node, i, blocks

    def match_prefix(
        self, token_ids: Sequence[int], extra_key: bytes, block_keys: Sequence[bytes] | None = None
    ) -> PrefixMatch:
        node, _, blocks = self._walk(self._root(extra_key), token_ids, 0)
        return PrefixMatch(blocks, node)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after k blocks; the new upper node is returned, `node` keeps the rest."""
        bs = self.block_size
        top = RadixNode(node.tokens[: k * bs], node.blocks[:k], node.parent, last_access=node.last_access)
        node.parent.children[self._block_key(top.tokens, 0)] = top
        node.tokens, node.blocks, node.parent = node.tokens[k * bs :], node.blocks[k:], top
        top.children[self._block_key(node.tokens, 0)] = node
        for b in top.blocks:
            self.node_of[b.block_id] = top
        return top

    def insert(
        self,
        handle: object,
        token_ids: Sequence[int],
        blocks: list[KVCacheBlock],
        extra_key: bytes,
        block_keys: Sequence[bytes] | None = None,
    ) -> tuple[object, list[KVCacheBlock]]:
        assert isinstance(handle, RadixNode) and len(token_ids) == len(blocks) * self.block_size
        node, i, held = self._walk(handle, token_ids, 0)
        if i < len(blocks):
            node = self._add_leaf(node, list(token_ids[i * self.block_size :]), blocks[i:])
            held += node.blocks
        return node, held

    def _add_leaf(self, parent: RadixNode, tokens: list[int], blocks: list[KVCacheBlock]) -> RadixNode:
        leaf = RadixNode(tokens, blocks, parent, last_access=next(self._clock))
        parent.children[self._block_key(tokens, 0)] = leaf
        if parent in self.evictable_leaves:  # not a leaf any more
            self.evictable_leaves.remove(parent)
        for b in blocks:
            b.cached = True
            self.node_of[b.block_id] = leaf
        return leaf

    def _nodes(self, blocks: list[KVCacheBlock]) -> list[RadixNode]:
        return list(dict.fromkeys(self.node_of[b.block_id] for b in blocks))

    def lock(self, blocks: list[KVCacheBlock]) -> None:
        for node in self._nodes(blocks):
            if node in self.evictable_leaves:
                self.evictable_leaves.remove(node)
        self._num_evictable -= len(blocks)

    def unlock(self, blocks: list[KVCacheBlock]) -> None:
        now = next(self._clock)
        for node in self._nodes(blocks):
            node.last_access = now
            if not node.children:
                self.evictable_leaves.add(node)
        self._num_evictable += len(blocks)

    def evict(self, n: int) -> list[KVCacheBlock]:
        evicted: list[KVCacheBlock] = []
        while len(evicted) < n and self.evictable_leaves:
            leaf = self.evictable_leaves[0]
            take = min(n - len(evicted), len(leaf.blocks))
            evicted += reversed(leaf.blocks[-take:])  # a node's tail goes first
            if take == len(leaf.blocks):
                self._remove_leaf(leaf)
            else:
                del leaf.blocks[-take:], leaf.tokens[-take * self.block_size :]
        for b in evicted:
            del self.node_of[b.block_id]
            b.cached = False
        self._num_evictable -= len(evicted)
        self.num_evictions += len(evicted)
        return evicted

    def _remove_leaf(self, leaf: RadixNode) -> None:
        self.evictable_leaves.remove(leaf)
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._block_key(leaf.tokens, 0)]
        if not parent.children and not parent.in_use:
            self.evictable_leaves.add(parent)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    def holds(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.node_of

    def size_info(self) -> CacheSize:
        return CacheSize(cached_blocks=len(self.node_of), evictable_blocks=self._num_evictable)

    def check_integrity(self) -> None:
        seen: dict[int, RadixNode] = {}
        leaves, unreferenced = set(), 0
        for root in self.roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self._check_node(node)
                seen |= {b.block_id: node for b in node.blocks}
                unreferenced += 0 if node.in_use else len(node.blocks)
                if not node.children and not node.in_use:
                    leaves.add(node.node_id)
                stack += node.children.values()
        assert seen == self.node_of, "node_of disagrees with the tree"
        assert {n.node_id for n in self.evictable_leaves} == leaves, "evictable leaves out of date"
        assert unreferenced == self._num_evictable, f"{unreferenced} unreferenced, counted {self._num_evictable}"

    def _check_node(self, node: RadixNode) -> None:
        assert node.blocks and len(node.tokens) == len(node.blocks) * self.block_size
        assert node.parent is not None and node.parent.children[self._block_key(node.tokens, 0)] is node
        assert all(b.cached and b.ref_cnt == node.blocks[0].ref_cnt for b in node.blocks), "mixed holders"
        assert not node.in_use or node.parent.in_use, "a node in use under an unused parent"
