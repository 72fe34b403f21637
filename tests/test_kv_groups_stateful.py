"""KV cache groups (a full group and sliding-window groups over one pool): block accounting
under prefix caching (radix and hash), forks, preemption and frees, against a model of the
K/V store; and the window's bound on a long chat.

Every slot written records the group and the exact prefix whose K/V it holds: a window
block released and reused by someone else, then still read, or a hit that skipped a block
its window needs, reads back the wrong prefix.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.engine.request import Request
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, cdiv, make_prefix_cache
from kvserve.kv_cache.kv_groups import KVCacheConfig
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.sampling_params import SamplingParams

BS, WINDOW = 4, 7  # a window that is not a multiple of the block
# two window layers and one full one: groups of one layer each, the full group first
KV_CONFIG = KVCacheConfig.from_layer_windows([WINDOW, None, WINDOW])
PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 0, 0), (7,) * 10, ()]
SALTS = [b"", extra_key("tenant-a")]
TOKENS = st.integers(0, 2)


def tables(kv: KVCacheManager, req: Request) -> list[list]:
    """The request's table in every group (None: a block its window has passed)."""
    return [kv.block_tables.get(req.seq_id, [])] + [t.get(req.seq_id, []) for t in kv.group_tables]


class KVGroupsMachine(RuleBasedStateMachine):
    kind: ClassVar[str | None]

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.store: dict[tuple[int, int], tuple] = {}  # (block, offset) -> (group, extra key, prefix)

    @initialize(num_blocks=st.integers(12, 40))
    def setup(self, num_blocks: int) -> None:
        cache = make_prefix_cache(self.kind, BS)
        self.kv = KVCacheManager(num_blocks, BS, cache, kv_config=KV_CONFIG)

    # helpers

    def _run(self, req: Request, n: int, hit=None) -> bool:
        """allocate_slots, then the step: copies, every group's writes, advance, cache."""
        kv = self.kv
        start = req.num_computed_tokens + (hit.num_blocks * BS if hit else 0)
        if not kv.allocate_slots(req, n, hit):
            return False
        for copy in kv.take_pending_copies():
            for off in range(BS):
                if (copy.src, off) in self.store:
                    self.store[(copy.dst, off)] = self.store[(copy.src, off)]
        for g, table in enumerate(tables(kv, req)):
            for pos in range(start, start + n):
                block = table[pos // BS]
                assert block is not None, "a new token's block was released"
                self.store[(block.block_id, pos % BS)] = (g, req.extra_key, tuple(req.all_token_ids[: pos + 1]))
        req.num_computed_tokens = start + n
        kv.cache_full_blocks(req)
        return True

    def _admit(self, req: Request, chunk: int) -> bool:
        hit = self.kv.match_prefix(req)
        cached = hit.num_blocks * BS if hit else 0
        return self._run(req, min(chunk, req.num_tokens - cached), hit)

    # rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(TOKENS, min_size=1, max_size=12),
        salt=st.sampled_from(SALTS),
        chunk=st.integers(1, 30),
    )
    def add(self, prefix, tail, salt, chunk) -> None:
        req = Request(f"r{next(self.ids)}", list(prefix) + tail, SamplingParams(), extra_key=salt)
        if self._admit(req, chunk):
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 9), token=TOKENS)
    def step(self, data, n, token) -> None:
        """The next prefill chunk, or a decode after appending a sampled token."""
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(token, None)
        self._run(req, min(n, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.running))
        child = parent.fork_beam()  # its history whole (fork() is for siblings at the prompt end)
        self.kv.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 30))
    def resume(self, data, chunk) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        if self._admit(req, chunk):
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.running.remove(req)
        self.kv.free(req)

    # invariants

    @invariant()
    def accounting_holds(self) -> None:
        kv = self.kv
        kv.check_integrity()  # the pool's, every group's cache's, ref counts = tables holding
        pool = kv.pool
        assert pool.num_free_blocks + pool.num_evictable_blocks + pool.num_used_blocks == pool.num_blocks
        held = Counter(b.block_id for r in self.running for t in tables(kv, r) for b in t if b is not None)
        assert sum(held.values()) == sum(b.ref_cnt for b in pool.blocks)

    @invariant()
    def windows_hold_only_their_window(self) -> None:
        for req in self.running:
            c = req.num_computed_tokens
            for spec, table in zip(KV_CONFIG.groups, tables(self.kv, req), strict=True):
                assert len(table) == cdiv(c, BS)
                first = spec.first_needed_block(c, BS)
                assert all(b is None for b in table[:first]), "a block the window has passed is still held"
                assert all(b is not None for b in table[first:])
                if spec.sliding_window is not None:
                    assert len(table) - first <= cdiv(WINDOW, BS) + 1

    @invariant()
    def every_request_reads_back_what_its_next_query_sees(self) -> None:
        for req in self.running:
            c = req.num_computed_tokens
            for g, (spec, table) in enumerate(zip(KV_CONFIG.groups, tables(self.kv, req), strict=True)):
                for pos in range(spec.first_needed_block(c, BS) * BS, c):
                    got = self.store.get((table[pos // BS].block_id, pos % BS))
                    assert got == (g, req.extra_key, tuple(req.all_token_ids[: pos + 1])), f"group {g} pos {pos}"

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for req in self.running:
            self.kv.free(req)
        self.kv.check_integrity()
        assert self.kv.pool.num_used_blocks == 0


class RadixGroups(KVGroupsMachine):
    kind = "radix"


class HashGroups(KVGroupsMachine):
    kind = "hash"


class NoCacheGroups(KVGroupsMachine):
    kind = None


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRadixGroups = RadixGroups.TestCase
TestRadixGroups.settings = SETTINGS
TestHashGroups = HashGroups.TestCase
TestHashGroups.settings = SETTINGS
TestNoCacheGroups = NoCacheGroups.TestCase
TestNoCacheGroups.settings = SETTINGS


def test_a_request_2000_tokens_into_a_chat_holds_one_window_per_window_group() -> None:
    """Gemma 3's layout (16-token blocks, 512-token window on 5 of 6 layers): chat turns of
    prefill chunks and decodes up to 2,000+ tokens; after every step each window group holds at
    most ceil(512 / 16) + 1 blocks, the full group all of them."""
    config = KVCacheConfig.from_layer_windows([512 if (i + 1) % 6 else None for i in range(18)])
    kv = KVCacheManager(1000, 16, make_prefix_cache("radix", 16), kv_config=config)
    req = Request("chat", [1] * 300, SamplingParams())
    turns = itertools.cycle([(120, 250), (60, 40)])  # (decoded reply, next user turn)
    while req.num_tokens < 2100:
        while req.num_computed_tokens < req.num_tokens:  # the turn's prefill, in chunks of 256
            n = min(256, req.num_tokens - req.num_computed_tokens)
            assert kv.allocate_slots(req, n)
            req.num_computed_tokens += n
            kv.cache_full_blocks(req)
        reply, user = next(turns)
        for t in range(reply):
            req.append_output_token(t % 7, None)
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            kv.cache_full_blocks(req)
            held = [sum(b is not None for b in t.get(req.seq_id, [])) for t in kv.group_tables]
            assert max(held) <= -(-512 // 16) + 1
        req.all_token_ids.extend([3] * user)
        req.prompt_token_ids.extend([3] * user)
    assert len(kv.block_tables[req.seq_id]) == cdiv(req.num_computed_tokens, 16)  # the full group keeps all
    kv.free(req)
    kv.check_integrity()


def test_gemma3_270m_layout_and_sizing() -> None:
    """18 layers, global on 5, 11 and 17: one full group and five window groups of three layers
    (so three KV tensors); a 4k-token request holds > 70% less KV than with every layer full."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    config = KVCacheConfig.from_layer_windows(windows)
    assert [g.layers for g in config.groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16),
    ]  # fmt: skip
    assert config.num_slots == 3 and [s for _, s in config.layer_slots()][:6] == [0, 1, 2, 0, 1, 0]
    layer_bytes, tokens = 1024, 4096 + 32  # bf16: 2 x 1 KV head x 256 dims x 2 bytes
    hybrid = config.request_bytes(tokens, layer_bytes, 16)
    full = KVCacheConfig.single(18).request_bytes(tokens, layer_bytes, 16)
    assert hybrid == 3 * layer_bytes * 16 * (258 + 5 * 33)
    assert 1 - hybrid / full > 0.70
    # a decode reads the full layers' whole context and the window layers' last 512 tokens
    assert config.read_bytes(tokens, layer_bytes) == layer_bytes * (3 * tokens + 15 * 512)
    assert config.read_bytes(100, layer_bytes) == KVCacheConfig.single(18).read_bytes(100, layer_bytes)
    assert config.max_tokens(num_blocks=1000, block_size=16) == (1000 - 5 * 33) * 16
    assert KVCacheConfig.single(30).groups[0].layers == tuple(range(30))  # Llama: one group, as before
