"""What the scheduler talks to: match a cached prefix, allocate slots, fork, free.

Each request owns a `BlockTable`, its physical blocks in logical order. Blocks are
taken only when tokens are about to be written and given back the moment a
request finishes, is aborted or preempted. A failed allocation changes nothing.
With a prefix cache, a new request starts from the cached blocks of its longest
cached prefix, and every block that fills (prompt or generated tokens) is
inserted so later requests, and this one after a preemption, find it.

A prefix no request has finished computing is shared too: the full blocks a step will
fill are registered, by their chained keys, as they are allocated ("in flight"), and a
request admitted in the same step continues its match through them. Its attention reads
them in the same forward, after they are written: every layer writes the step's new K/V
before it attends. So requests that arrive together compute a shared prefix once, with
no one waiting for another (SGLang instead defers the followers by a step).

With tiers below the pool (`tiers.store.TieredKVStore`), a request's match continues
there: `start_load` looks up the blocks after its device hit, the request waits (off
the step loop) while they arrive, and `queue_loads` writes them into freshly allocated
blocks before the step's forward. Blocks leaving the pool, or filling, are queued in
`pending_saves` for the engine to read out and store.

KV groups (`kv_groups.py`; Gemma 3's sliding-window layers): every group after the
first has its own table per request (`group_tables`) and, with prefix caching, its own
`HashChainCache`; the first group, full attention, keeps `block_tables` and the
configured prefix cache, and only its blocks are announced as KV events (a router
matches prefixes by them). A window group's blocks that the window has passed are
released at once (their table entries become None): a cached one stays matchable until
evicted, as in vLLM, so a later request sharing the prefix finds the blocks still in its
window; an uncached one is free. A prefix hit is then the longest one the first group
holds whose window every other group still holds; it continues through in-flight blocks
and loaded ones the same way (`_longest_run`). In flight and in the tiers, a group's
block goes by `group_key`; a load first fetches the first group's run, then the other
groups' blocks that a query at its end still sees (`WindowLoad`), and keeps the longest
run every group can serve.

Prefill/decode disaggregation: a prefill replica `hold`s a finished prompt's cached
blocks under a lease (one more reference each, so they are neither evicted nor freed)
until the decode replica has pulled them (`release`) or the lease runs out
(`expire_leases`). A pull names block keys; only the leading run equal to the lease's
own keys is served, and keys carry the tenant's salt, so another tenant's pull gets none.
A pull reads the blocks on its own thread, not between steps (`begin_read`, `end_read`,
under `lease_lock`, the one part of this class another thread calls): a held block is never
written, and a lease being read neither expires nor frees its blocks until the read ends.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvserve.kv_cache.block_keys import extend_keys, group_key
from kvserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kv_cache.group_evictor import GroupedEvictor
from kvserve.kv_cache.hash_chain_cache import HashChainCache
from kvserve.kv_cache.kv_groups import KVCacheConfig
from kvserve.kv_cache.prefix_cache import PrefixCache, PrefixMatch
from kvserve.kv_cache.radix_cache import RadixCache
from kvserve.kv_cache.request import KVRequest
from kvserve.kv_cache.tiers.store import KVLoad, Payload, TieredKVStore

PREFIX_CACHES: dict[str, type[PrefixCache]] = {"radix": RadixCache, "hash": HashChainCache}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_prefix_cache(kind: str | None, block_size: int) -> PrefixCache | None:
    if kind is None:
        return None
    if kind not in PREFIX_CACHES:
        raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)}; got {kind!r}")
    return PREFIX_CACHES[kind](block_size)


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: copy K/V of block `src` into `dst` before this step's forward."""

    src: int
    dst: int


@dataclass
class CachedPrefix:
    """How much of a request's table the prefix cache holds, and where to continue."""

    handle: object
    num_blocks: int


@dataclass(frozen=True)
class PrefixHit:
    """A new request's reusable prefix: what the prefix cache holds, then blocks that
    requests scheduled in this step are computing."""

    cached: PrefixMatch
    in_flight: list[KVCacheBlock]
    group_blocks: tuple[list[KVCacheBlock | None], ...] = ()  # groups after the first: None before the window

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.cached.blocks + self.in_flight

    @property
    def num_blocks(self) -> int:
        return self.cached.num_blocks + len(self.in_flight)


@dataclass(frozen=True)
class BlockSave:
    """Read block `block_id`'s K/V out and store it under `block_key`: it just filled
    (`filled`), or it is being evicted and is rewritten by this step's forward."""

    block_key: bytes
    block_id: int
    filled: bool
    group: int = 0  # its KV group: the first group's blocks alone are announced as events


@dataclass(frozen=True)
class BlockLoad:
    """Write `payload` (from a tier) into block `block_id` before this step's forward."""

    block_id: int
    payload: Payload


@dataclass
class WindowLoad:
    """A load with several KV groups, once the first group's part is over: its blocks from
    `first_block` to `end`, and where each other group's lookup starts (the first block a
    query at `end` sees, or the device hit's end); their blocks are the request's load now."""

    first: list[tuple[str, Payload]]
    starts: list[int]
    end: int


@dataclass
class Lease:
    """A prefill replica's hold on a finished prompt's blocks, for a decode replica to pull."""

    blocks: list[KVCacheBlock]
    block_keys: list[bytes]
    deadline: float  # time.monotonic()
    readers: int = 0  # pulls reading its blocks now
    released: bool = False  # released while read: freed once the last read ends


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens found cached in the device pool
    external_queries: int = 0  # tokens looked up in the tiers (after the device hit)
    external_hits: int = 0  # of those, tokens loaded from a tier


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        store: TieredKVStore | None = None,
        events: str | None = None,
        kv_config: KVCacheConfig | None = None,
    ):
        """`events`: None (no events kept), "hashes" or "tokens" (token ids too: an opt-in).
        `kv_config`: the KV groups (default: one, every layer full)."""
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.kv_config = kv_config
        self.groups = kv_config.groups[1:] if kv_config else ()  # the groups after the first
        self.group_caches = [HashChainCache(block_size) if prefix_cache else None for _ in self.groups]
        caches = [prefix_cache, *self.group_caches]
        evictor = GroupedEvictor(caches) if prefix_cache is not None and self.groups else prefix_cache
        self.store = store if prefix_cache is not None else None
        self.pool = BlockPool(num_blocks, evictor=evictor, on_evict=self._on_evict)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}  # by KVRequest.seq_id
        self.group_tables: list[dict[int, list[KVCacheBlock | None]]] = [{} for _ in self.groups]
        self.cached_prefixes: dict[int, CachedPrefix] = {}  # by KVRequest.seq_id
        self.pending_copies: list[BlockCopy] = []
        self.in_flight: dict[bytes, KVCacheBlock] = {}  # block key -> block being filled this step
        self.num_cow_copies = 0
        self.prefix_stats = PrefixCacheStats()
        self.loads: dict[int, KVLoad] = {}  # by KVRequest.seq_id: lookups in the tiers
        self.window_loads: dict[int, WindowLoad] = {}  # by KVRequest.seq_id, with several groups
        self.pending_saves: list[BlockSave] = []
        self.pending_loads: list[BlockLoad] = []
        self.events: list[KVCacheEvent] | None = [] if events else None
        self.event_token_ids = events == "tokens"
        self.leases: dict[str, Lease] = {}  # by the prefill request's id
        self.lease_lock = threading.Lock()  # leases are read by pulls on other threads
        self.num_expired_leases = 0

    @property
    def num_tokens_capacity(self) -> int:
        """The longest request the pool holds alone (every group's blocks for it)."""
        if not self.groups:
            return self.pool.num_blocks * self.block_size
        return self.kv_config.max_tokens(self.pool.num_blocks, self.block_size)

    def block_ids(self, request: KVRequest, group: int = 0) -> list[int]:
        """The request's table in KV group `group`; blocks the window has passed read as 0 (never read)."""
        if group == 0:
            return [b.block_id for b in self.block_tables.get(request.seq_id, ())]
        return [0 if b is None else b.block_id for b in self.group_tables[group - 1].get(request.seq_id, ())]

    def fitting_tokens(self, request: KVRequest, n: int, hit: PrefixHit | None = None, loaded: int = 0) -> int:
        """At most `n` new tokens (after `loaded` ones), as many as the whole pool has room for
        beside the request's own blocks. With several groups a chunk takes blocks in every
        group, so a long prompt chunk may not fit even an empty pool (it would wait, or preempt
        itself, forever); with one, a request that fits the pool (checked at admission) fits."""
        if not self.groups or n <= 1:
            return n
        held = len(self.block_tables.get(request.seq_id, ()))
        held += sum(sum(b is not None for b in t.get(request.seq_id, ())) for t in self.group_tables)
        room = self.pool.num_blocks - held
        fits = bisect.bisect_right(range(1, n + 1), room, key=lambda k: self.blocks_needed(request, loaded + k, hit))
        return max(1, fits)

    def match_prefix(self, request: KVRequest) -> PrefixHit | None:
        """The blocks a request with no blocks yet can start from: cached, then in flight (changes no ref count)."""
        if self.prefix_cache is None:
            return None
        usable = (request.num_tokens - 1) // self.block_size  # blocks: the last token's logits are needed
        keys = self._block_keys(request, usable)[:usable]
        cached = self.prefix_cache.match_prefix(
            request.all_token_ids[: usable * self.block_size], request.extra_key, keys
        )
        if self.groups:
            return self._match_groups(request, keys, cached)
        in_flight = []
        for key in keys[cached.num_blocks :]:
            if key not in self.in_flight:
                break
            in_flight.append(self.in_flight[key])
        return PrefixHit(cached, in_flight)

    def _match_groups(self, request: KVRequest, keys: list[bytes], cached: PrefixMatch) -> PrefixHit:
        """The longest hit of the first group whose window (all of it, for a full group) each
        other group still holds; the first group's match cut back to it where needed."""
        n = cached.num_blocks
        while True:
            shorter = min((self._group_hit(g, keys, n) for g in range(len(self.groups))), default=n)
            if shorter == n:
                break
            n = shorter
        if n < cached.num_blocks:  # re-matched, so the radix tree splits its node at the new end
            tokens = request.all_token_ids[: n * self.block_size]
            cached = self.prefix_cache.match_prefix(tokens, request.extra_key, keys[:n])
        first = [spec.first_needed_block(n * self.block_size, self.block_size) for spec in self.groups]
        blocks = tuple(
            [None] * f + [self.group_caches[g].blocks_by_hash[k] for k in keys[f:n]] for g, f in enumerate(first)
        )
        return self._continue_in_flight(keys, PrefixHit(cached, [], blocks))

    def _continue_in_flight(self, keys: list[bytes], hit: PrefixHit) -> PrefixHit:
        """A groups' hit continued through blocks in flight, as far as every group has them."""
        n = hit.num_blocks
        end = n
        while end < len(keys) and keys[end] in self.in_flight:
            end += 1
        if end == n:
            return hit
        starts = self._window_starts(n, end)
        ends = list(starts)
        for g in range(len(starts)):
            while ends[g] < end and group_key(keys[ends[g]], g + 1) in self.in_flight:
                ends[g] += 1
        m = self._longest_run(n, end, starts, ends)
        if m == n:
            return hit
        group_blocks = self._window_layout(hit, m)
        for g, blocks in enumerate(group_blocks):
            blocks += [self.in_flight[group_key(keys[i], g + 1)] for i in range(len(blocks), m)]
        return PrefixHit(hit.cached, [self.in_flight[k] for k in keys[n:m]], group_blocks)

    def _window_starts(self, n: int, end: int) -> list[int]:
        """Per group after the first: the first block past a hit of `n` blocks that a query at `end` sees."""
        return [max(n, spec.first_needed_block(end * self.block_size, self.block_size)) for spec in self.groups]

    def _longest_run(self, n: int, end: int, starts: list[int], ends: list[int]) -> int:
        """The longest hit, from `n` up to `end` blocks, that every other group can serve: group g
        has its device hit's blocks below `n` and blocks [starts[g], ends[g]) past it."""
        bs = self.block_size
        for m in range(min(end, *ends), n, -1):
            if all(max(g.first_needed_block(m * bs, bs), n) >= s for g, s in zip(self.groups, starts, strict=True)):
                return m
        return n

    def _window_layout(self, hit: PrefixHit, m: int) -> tuple[list[KVCacheBlock | None], ...]:
        """The other groups' hit blocks for a hit of `m` blocks: the device hit's that a query at
        `m` still sees, None before them and up to the first block past the device hit it sees."""
        n, bs = hit.num_blocks, self.block_size
        layout = []
        for spec, blocks in zip(self.groups, hit.group_blocks, strict=True):
            first = spec.first_needed_block(m * bs, bs)
            layout.append([b if i >= first else None for i, b in enumerate(blocks)] + [None] * max(0, first - n))
        return tuple(layout)

    def _group_hit(self, g: int, keys: list[bytes], n: int) -> int:
        """The most blocks, up to n, whose prefix group g can continue: it holds every block a
        query after them still sees."""
        spec, cache = self.groups[g], self.group_caches[g]
        while n > 0:
            first = spec.first_needed_block(n * self.block_size, self.block_size)
            missing = [i for i in range(first, n) if keys[i] not in cache.blocks_by_hash]
            if not missing:
                return n
            n = missing[-1]  # a hit must end before the last missing block
        return 0

    def _block_keys(self, request: KVRequest, num_blocks: int) -> list[bytes]:
        """The request's chained block keys, its first `num_blocks` at least (each computed once)."""
        extend_keys(request.block_keys, request.all_token_ids, num_blocks, self.block_size, request.extra_key)
        return request.block_keys

    def blocks_needed(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Blocks (new ones, a copy-on-write one, evictable hits revived) that scheduling these tokens takes."""
        hit_blocks = hit.blocks if hit else []
        start = request.num_computed_tokens + len(hit_blocks) * self.block_size
        end = start + num_new_tokens
        need = self._table_need(self.block_tables.get(request.seq_id, []), hit_blocks, start, end)
        for g, tables in enumerate(self.group_tables):
            group_hit = hit.group_blocks[g] if hit else []
            need += self._table_need(tables.get(request.seq_id, []), group_hit, start, end)
        return need

    def _table_need(
        self, table: list[KVCacheBlock | None], hit_blocks: list[KVCacheBlock | None], start: int, end: int
    ) -> int:
        """`blocks_needed` for one group's table."""
        grow = max(0, cdiv(end, self.block_size) - max(len(table), len(hit_blocks)))
        revived = sum(1 for b in hit_blocks if b is not None and b.ref_cnt == 0)
        return grow + revived + int(self._shared_tail(table, start) is not None)

    def allocate_slots(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` after the computed (and hit) ones; False, and no change, if out of blocks.

        `hit` (from `match_prefix`) is only given for a request that holds no blocks yet.
        Blocks a window has passed are released first, whatever the outcome: the request
        can no longer see them.
        """
        if self.groups:
            self.release_out_of_window(request)
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_available_blocks:
            return False
        table = self.block_tables.setdefault(request.seq_id, [])
        if hit is not None:
            self.pool.incr_ref(hit.blocks)  # before allocating, so eviction cannot take them
            table.extend(hit.blocks)
            self.cached_prefixes[request.seq_id] = CachedPrefix(hit.cached.handle, hit.cached.num_blocks)
            for g, blocks in enumerate(hit.group_blocks):  # every group's hit held before anything is evicted
                self.pool.incr_ref([b for b in blocks if b is not None])
                self.group_tables[g].setdefault(request.seq_id, []).extend(blocks)
        start = request.num_computed_tokens + (hit.num_blocks * self.block_size if hit else 0)
        self._extend_table(table, start, start + num_new_tokens)
        self._register_in_flight(request, table, start, start + num_new_tokens)
        for g, tables in enumerate(self.group_tables, start=1):
            group_table = tables.setdefault(request.seq_id, [])
            self._extend_table(group_table, start, start + num_new_tokens)
            self._register_in_flight(request, group_table, start, start + num_new_tokens, g)
        return True

    def _extend_table(self, table: list[KVCacheBlock | None], start: int, end: int) -> None:
        """One group's table made to cover tokens [start, end), the room checked for every group:
        a copy of the shared partly filled block the tokens write to, then new blocks."""
        shared = self._shared_tail(table, start)
        if shared is not None:
            self._copy_on_write(table, shared)
        grow = cdiv(end, self.block_size) - len(table)
        if grow > 0:
            table.extend(self.pool.get_new_blocks(grow))

    def release_out_of_window(self, request: KVRequest) -> None:
        """Give back the window groups' blocks no query from `num_computed_tokens` on can see
        (cached ones stay matchable until evicted); tail first, as `free` does."""
        for spec, tables in zip(self.groups, self.group_tables, strict=True):
            table = tables.get(request.seq_id)
            if not table or spec.sliding_window is None:
                continue
            first = min(spec.first_needed_block(request.num_computed_tokens, self.block_size), len(table))
            passed = [b for b in table[:first] if b is not None]
            if passed:
                table[:first] = [None] * first
                self.pool.free_blocks(reversed(passed))

    def _register_in_flight(
        self, request: KVRequest, table: list[KVCacheBlock | None], start: int, end: int, group: int = 0
    ) -> None:
        """The blocks of KV group `group` that tokens [start, end) fill, matchable by requests
        admitted in the same step."""
        first, last = start // self.block_size, end // self.block_size
        if self.prefix_cache is None or first == last:  # most decodes fill no block
            return
        keys = self._block_keys(request, last)
        for i in range(first, last):
            key = group_key(keys[i], group)
            if table[i] is not None and key not in self.in_flight and not table[i].cached:  # None: a loaded
                self.in_flight[key] = table[i]  # run's blocks before the window

    def _drop_in_flight(
        self, request: KVRequest, table: list[KVCacheBlock | None], first: int, last: int, group: int = 0
    ) -> None:
        """Forget table[first:last]'s in-flight entries: computed now, or their request freed."""
        for key, block in zip(request.block_keys[first:last], table[first:last], strict=False):
            key = group_key(key, group)
            if block is not None and self.in_flight.get(key) is block:
                del self.in_flight[key]

    def _shared_tail(self, table: list[KVCacheBlock | None], start: int) -> int | None:
        """Index of the partly filled block the next token goes into, if others share it."""
        idx = start // self.block_size
        if start % self.block_size and idx < len(table) and table[idx] is not None and table[idx].ref_cnt > 1:
            return idx
        return None

    def _copy_on_write(self, table: list[KVCacheBlock | None], idx: int) -> None:
        old = table[idx]
        (new,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([old])  # the other owners keep it
        table[idx] = new
        self.pending_copies.append(BlockCopy(old.block_id, new.block_id))
        self.num_cow_copies += 1

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, request: KVRequest) -> None:
        """Insert the blocks this request has filled since the last call (prompt and output tokens);
        then release the window groups' blocks the next query no longer sees."""
        if self.groups:
            self._cache_group_blocks(request)
            self.release_out_of_window(request)
        if self.prefix_cache is None:
            return
        table = self.block_tables[request.seq_id]
        done = self.cached_prefixes.get(request.seq_id) or CachedPrefix(
            self.prefix_cache.root_handle(request.extra_key), 0
        )
        full = request.num_computed_tokens // self.block_size
        if full <= done.num_blocks:
            return
        bs = self.block_size
        tokens = request.all_token_ids[done.num_blocks * bs : full * bs]
        keys = self._block_keys(request, full)[done.num_blocks : full]
        self._drop_in_flight(request, table, done.num_blocks, full)  # computed now: the cache holds them
        handle, held = self.prefix_cache.insert(
            done.handle, tokens, table[done.num_blocks : full], request.extra_key, keys
        )
        stored = []
        for i, block in enumerate(held, start=done.num_blocks):
            if block is not table[i]:  # someone cached this prefix first: share theirs, drop ours
                self.pool.incr_ref([block])
                self.pool.free_blocks([table[i]])
                table[i] = block
            elif block.block_key is None:
                self._offer(block, request.block_keys[i])
                stored.append(i)
        self.cached_prefixes[request.seq_id] = CachedPrefix(handle, full)
        if stored and self.events is not None:
            self._announce_stored(request, stored)

    def _cache_group_blocks(self, request: KVRequest) -> None:
        """cache_full_blocks for the groups after the first (before the first group's, which
        moves `cached_prefixes` on): their blocks filled since, under the same chained keys."""
        if self.prefix_cache is None:
            return
        done = self.cached_prefixes[request.seq_id].num_blocks if request.seq_id in self.cached_prefixes else 0
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        bs, keys = self.block_size, self._block_keys(request, full)
        for g, (cache, tables) in enumerate(zip(self.group_caches, self.group_tables, strict=True), start=1):
            table = tables[request.seq_id]
            self._drop_in_flight(request, table, done, full, g)
            for i in range(done, full):
                if table[i] is None:
                    continue
                tokens = request.all_token_ids[i * bs : (i + 1) * bs]
                _, (held,) = cache.insert(b"", tokens, [table[i]], request.extra_key, [keys[i]])
                if held is not table[i]:  # cached first by another request: share theirs
                    self.pool.incr_ref([held])
                    self.pool.free_blocks([table[i]])
                    table[i] = held
                elif held.block_key is None:
                    self._offer(held, group_key(keys[i], g), g)

    def _offer(self, block: KVCacheBlock, key: bytes, group: int = 0) -> None:
        """A block this request computed is cached now: the tiers may want it now and on eviction."""
        block.block_key, block.group = key, group
        if self.store is not None and self.store.saves_on_fill:
            self.pending_saves.append(BlockSave(key, block.block_id, filled=True, group=group))

    def _announce_stored(self, request: KVRequest, indexes: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, with the parent of its first."""
        bs, keys = self.block_size, request.block_keys
        runs: list[list[int]] = []
        for i in indexes:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            tokens = request.all_token_ids[run[0] * bs : (run[-1] + 1) * bs] if self.event_token_ids else []
            parent = keys[run[0] - 1] if run[0] else None
            self.events.append(BlockStored([keys[i] for i in run], parent, tokens, bs))

    def _on_evict(self, blocks: list[KVCacheBlock]) -> None:
        removed = []
        for block in blocks:
            if block.block_key is None:
                continue
            if self.store is not None and self.store.saves_on_evict:
                self.pending_saves.append(BlockSave(block.block_key, block.block_id, False, block.group))
            if block.group == 0:
                removed.append(block.block_key)
            block.block_key, block.group = None, 0
        if removed and self.events is not None:
            self.events.append(BlockRemoved(removed))

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events or [], [] if self.events is not None else None
        return events

    def take_pending_saves(self) -> list[BlockSave]:
        saves, self.pending_saves = self.pending_saves, []
        return saves

    def take_pending_loads(self) -> list[BlockLoad]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def cached_block_saves(self) -> list[BlockSave]:
        """Every cached block, as an eviction would save it (a write-back cache's flush at shutdown)."""
        return [
            BlockSave(b.block_key, b.block_id, False, b.group) for b in self.pool.blocks if b.cached and b.block_key
        ]

    # loads from the tiers

    def start_load(self, request: KVRequest, hit: PrefixHit | None) -> bool:
        """Look the blocks after a waiting request's device hit up in the tiers, once per
        admission; True while it must wait for them (then poll `load_ready`)."""
        if self.store is None or request.seq_id in self.loads:
            return False
        first = hit.num_blocks if hit else 0
        usable = (request.num_tokens - 1) // self.block_size
        load = self.store.start_load(self._block_keys(request, usable)[first:usable], first)
        if load is None:
            return False
        self.loads[request.seq_id] = load
        return not self.load_ready(request)  # with several groups, this may start the other groups' part

    def wait_for_load(self, request: KVRequest, until: float) -> bool:
        """Wait until `until` (time.monotonic()) at most for the request's load; True once it is over."""
        load = self.loads[request.seq_id]
        if (left := until - time.monotonic()) > 0:
            self.store.wait_for_loads([load], timeout=left)
        return self.load_ready(request)

    def load_ready(self, request: KVRequest) -> bool:
        """Its load arrived, failed or timed out (then it computes what it would have loaded)."""
        load = self.loads.get(request.seq_id)
        if load is None:
            return True
        if not load.done:
            if time.monotonic() <= load.deadline:
                return False
            load.result = []
            self.store.record_timeout()
        if self.groups and request.seq_id not in self.window_loads:
            return not self._start_window_load(request, load)
        return True

    def _start_window_load(self, request: KVRequest, load: KVLoad) -> bool:
        """The first group's part of a load is over: look up the other groups' blocks a query
        after its run sees, position by position (a miss ends the run for every group after
        it). True while the request must wait for them."""
        first = load.payloads()
        n, end = load.first_block, load.first_block + len(first)
        starts = self._window_starts(n, end)
        keys = request.block_keys
        wanted = [group_key(keys[i], g) for i in range(min(starts), end) for g, s in enumerate(starts, 1) if s <= i]
        self.window_loads[request.seq_id] = WindowLoad(first, starts, end)
        window = self.store.start_load(wanted, n) if first and wanted else None
        self.loads[request.seq_id] = window or KVLoad(n, load.deadline, result=[])
        return window is not None and not window.done

    def loaded_blocks(
        self, request: KVRequest, hit: PrefixHit | None
    ) -> tuple[PrefixHit | None, list[tuple[str, Payload]]]:
        """The loaded blocks that continue the request's device hit now, as (tier, payload), and
        the hit to allocate them with (with several groups: their tables laid out for the run)."""
        load = self.loads.get(request.seq_id)
        if load is None:
            return hit, []
        skip = (hit.num_blocks if hit else 0) - load.first_block
        if not self.groups:
            return hit, load.payloads()[skip:] if skip >= 0 else []  # skip < 0: the blocks it continued were evicted
        if skip != 0 or hit is None:  # the device hit moved since the lookup: compute instead
            return hit, []
        m = self._window_run(request, hit)
        if m is None:
            return hit, []
        loaded = self.window_loads[request.seq_id].first[: m - hit.num_blocks]
        return dataclasses.replace(hit, group_blocks=self._window_layout(hit, m)), loaded

    def _window_run(self, request: KVRequest, hit: PrefixHit) -> int | None:
        """The longest loaded run every group can serve past the device hit; None if there is none."""
        window, n = self.window_loads.get(request.seq_id), hit.num_blocks
        if window is None or window.end == n:
            return None
        ends = [s + len(f) for s, f in zip(window.starts, self._window_found(request, window), strict=True)]
        m = self._longest_run(n, window.end, window.starts, ends)
        return None if m == n else m

    def _window_found(self, request: KVRequest, window: WindowLoad) -> list[list[tuple[str, Payload]]]:
        """Each other group's loaded blocks, from its `starts` on (the lookup went position by position)."""
        found: list[list[tuple[str, Payload]]] = [[] for _ in self.groups]
        arrived = iter(self.loads[request.seq_id].payloads())
        for i in range(min(window.starts), window.end):
            for g, s in enumerate(window.starts):
                if s <= i and (item := next(arrived, None)) is not None:
                    found[g].append(item)
        return found

    def queue_loads(self, request: KVRequest, first_block: int, loaded: list[tuple[str, Payload]]) -> None:
        """After `allocate_slots` covered them: write the loaded blocks into the tables' fresh blocks."""
        if loaded and self.groups:
            self._queue_window_loads(request, first_block + len(loaded))
        self.loads.pop(request.seq_id, None)
        self.window_loads.pop(request.seq_id, None)
        table = self.block_tables[request.seq_id]
        for i, (_, payload) in enumerate(loaded, start=first_block):
            self.pending_loads.append(BlockLoad(table[i].block_id, payload))
        if loaded:
            self.store.record_served(loaded)

    def _queue_window_loads(self, request: KVRequest, m: int) -> None:
        """The other groups' loaded blocks that a query at `m` sees, into their fresh blocks."""
        window = self.window_loads[request.seq_id]
        found = self._window_found(request, window)
        bs = self.block_size
        for spec, tables, start, items in zip(self.groups, self.group_tables, window.starts, found, strict=True):
            table = tables[request.seq_id]
            used = items[max(spec.first_needed_block(m * bs, bs), start) - start : m - start]
            first = m - len(used)
            self.pending_loads += [BlockLoad(table[first + k].block_id, p) for k, (_, p) in enumerate(used)]
            self.store.record_served(used)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """The child shares every block of the parent, the partly filled last one too."""
        table = self.block_tables[parent.seq_id]
        self.pool.incr_ref(table)
        self.block_tables[child.seq_id] = list(table)
        for tables in self.group_tables:
            table = tables[parent.seq_id]
            self.pool.incr_ref([b for b in table if b is not None])
            tables[child.seq_id] = list(table)
        if parent.seq_id in self.cached_prefixes:
            done = self.cached_prefixes[parent.seq_id]
            self.cached_prefixes[child.seq_id] = CachedPrefix(done.handle, done.num_blocks)

    def free(self, request: KVRequest) -> None:
        self.loads.pop(request.seq_id, None)
        self.window_loads.pop(request.seq_id, None)
        self.cached_prefixes.pop(request.seq_id, None)
        table = self.block_tables.pop(request.seq_id, [])
        self._drop_in_flight(request, table, 0, len(table))
        self.pool.free_blocks(reversed(table))  # tail first: evicted before its prefix
        for g, tables in enumerate(self.group_tables, start=1):
            group_table = tables.pop(request.seq_id, [])
            self._drop_in_flight(request, group_table, 0, len(group_table), g)
            self.pool.free_blocks([b for b in reversed(group_table) if b is not None])

    # leases (prefill/decode handoff)

    def hold(self, owner: str, request: KVRequest, seconds: float) -> list[int]:
        """Keep the request's cached blocks (its prompt's full blocks) for `seconds`, for a decode
        replica to load; returns their ids. All of them, not only the ones a decode replica loads:
        a radix node's blocks have one holder count."""
        done = self.cached_prefixes.get(request.seq_id)
        if self.prefix_cache is None or self.groups or done is None:  # with groups, the tiers are off too
            return []
        blocks = self.block_tables[request.seq_id][: done.num_blocks]
        if blocks:
            self.pool.incr_ref(blocks)
            with self.lease_lock:
                self.leases[owner] = Lease(blocks, request.block_keys[: len(blocks)], time.monotonic() + seconds)
        return [b.block_id for b in blocks]

    def begin_read(self, owner: str, block_keys: list[bytes], seconds: float) -> list[int]:
        """The ids of the leading run of `block_keys` that lease `owner` holds, renewed and kept
        from expiring or being freed until `end_read` (any thread; none: no `end_read`)."""
        with self.lease_lock:
            lease = self.leases.get(owner)
            if lease is None or lease.released:
                return []
            n = 0
            for held, asked in zip(lease.block_keys, block_keys, strict=False):
                if held != asked:
                    break
                n += 1
            lease.deadline = max(lease.deadline, time.monotonic() + seconds)
            lease.readers += n > 0
            return [b.block_id for b in lease.blocks[:n]]

    def end_read(self, owner: str) -> None:
        """A `begin_read` that returned blocks is done with them (any thread)."""
        with self.lease_lock:
            self.leases[owner].readers -= 1

    def release(self, owner: str) -> bool:
        """The decode side has the blocks, or gave up: drop the lease's references (now, or as the
        last read of them ends and the engine next expires leases)."""
        with self.lease_lock:
            lease = self.leases.get(owner)
            if lease is None:
                return False
            lease.released = True
            if lease.readers:
                return True
            del self.leases[owner]
        self.pool.free_blocks(reversed(lease.blocks))
        return True

    def expire_leases(self, now: float) -> int:
        """Free the leases past their deadline and those released while read; returns how many."""
        with self.lease_lock:
            done = [o for o, x in self.leases.items() if not x.readers and (x.released or x.deadline <= now)]
            self.num_expired_leases += sum(not self.leases[o].released for o in done)
            freed = [self.leases.pop(o) for o in done]
        for lease in freed:
            self.pool.free_blocks(reversed(lease.blocks))
        return len(freed)

    @property
    def num_leased_blocks(self) -> int:
        return len({b.block_id for lease in self.leases.values() for b in lease.blocks})

    def check_integrity(self) -> None:
        """The pool's and the prefix cache's invariants, each block's ref count = the tables (and
        leases) holding it, and the in-flight blocks held and not yet cached."""
        self.pool.check_integrity()
        for cache in [self.prefix_cache, *self.group_caches]:
            if cache is not None:
                cache.check_integrity()
        tables = [*self.block_tables.values(), *(t for group in self.group_tables for t in group.values())]
        tables += [lease.blocks for lease in self.leases.values()]
        held = Counter(b.block_id for table in tables for b in table if b is not None)
        wrong = [b.block_id for b in self.pool.blocks if b.ref_cnt != held[b.block_id]]
        assert not wrong, f"blocks {wrong[:5]} have ref counts that differ from the tables holding them"
        assert all(b.ref_cnt > 0 and not b.cached for b in self.in_flight.values()), (
            "an in-flight block is free or already cached"
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        if self.block_tables or any(self.group_tables):
            return False
        if self.prefix_cache is not None:
            self.pool.reclaim(self.pool.num_evictable_blocks)
            self.pending_saves.clear()  # forgotten here, not pushed down to the tiers
            if self.events is not None:
                self.events = [AllBlocksCleared()]
        return True
