"""Choosing a replica: cache_aware (Dynamo's cost), least_loaded, round_robin.

cache_aware, as Dynamo's KV router weighs it (`--kv-overlap-score-weight`, Dynamo's
`overlap_score_weight`, is the prefill weight):

    cost = weight * (uncached prompt tokens here + prefill tokens already queued here)
           + tokens of KV held by the requests running here

where a block found in the replica's device pool saves its whole prefill and one found in
a tier below (host RAM, disk) saves TIER_HIT_SAVING of it (it must still be loaded). The
cheapest replica wins; equal costs go to the less loaded, then to chance (never to the
order of --replica, which would pile every tie onto the first replica).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvserve.router.args import KV_OVERLAP_SCORE_WEIGHT, POLICIES
from kvserve.router.index import usable_blocks
from kvserve.router.replicas import Replica
from kvserve.router.request import RoutedRequest

TIER_HIT_SAVING = 0.8  # a block loaded from a tier saves most of its prefill; the copy or read is the rest


@dataclass(frozen=True)
class Decision:
    replica: Replica
    predicted_cached_tokens: int  # what the replica should report as usage.prompt_tokens_details.cached_tokens
    uncached_tokens: int  # prefill the request brings there (whole blocks found count as cached)
    cost: float
    load: float


def score(
    replica: Replica, request: RoutedRequest, now: float, prefill_weight: float = KV_OVERLAP_SCORE_WEIGHT
) -> Decision:
    bs = replica.info.block_size if replica.info else 1
    cached, saved = 0, 0.0
    for ids, keys in zip(request.prompts, request.keys, strict=True):
        run = replica.cached_run(keys[: usable_blocks(len(ids), bs)], now)
        cached += run.blocks * bs
        saved += (run.device_blocks + TIER_HIT_SAVING * run.tier_blocks) * bs
    uncached = request.num_prompt_tokens - cached
    load = replica.load_tokens()
    cost = prefill_weight * (request.num_prompt_tokens - saved + replica.pending_prefill_tokens())
    cost += replica.active_tokens()
    return Decision(replica, cached, uncached, cost, load)


class Policy:
    name = ""

    def __init__(self, prefill_weight: float = KV_OVERLAP_SCORE_WEIGHT) -> None:
        self.prefill_weight = prefill_weight

    def choose(self, request: RoutedRequest, candidates: list[Replica]) -> Decision | None:
        if not candidates:
            return None
        now = time.monotonic()
        return self.pick([score(r, request, now, self.prefill_weight) for r in candidates])

    def pick(self, scored: list[Decision]) -> Decision:
        raise NotImplementedError


class CacheAware(Policy):
    name = "cache_aware"

    def pick(self, scored: list[Decision]) -> Decision:
        return min(scored, key=lambda d: (d.cost, d.load, random.random()))


class LeastLoaded(Policy):
    name = "least_loaded"

    def pick(self, scored: list[Decision]) -> Decision:
        return min(scored, key=lambda d: (d.load, random.random()))


class RoundRobin(Policy):
    """The next replica after the last one chosen, skipping those not routable."""

    name = "round_robin"

    def __init__(self, prefill_weight: float = KV_OVERLAP_SCORE_WEIGHT) -> None:
        super().__init__(prefill_weight)
        self._last = -1

    def pick(self, scored: list[Decision]) -> Decision:
        after = [d for d in scored if d.replica.index > self._last]
        chosen = min(after or scored, key=lambda d: d.replica.index)
        self._last = chosen.replica.index
        return chosen


def make_policy(name: str, prefill_weight: float = KV_OVERLAP_SCORE_WEIGHT) -> Policy:
    policies: dict[str, type[Policy]] = {
        "cache_aware": CacheAware,
        "least_loaded": LeastLoaded,
        "round_robin": RoundRobin,
    }
    if name not in policies:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if not prefill_weight > 0:
        raise ValueError(f"--kv-overlap-score-weight must be > 0, got {prefill_weight}")
    return policies[name](prefill_weight)
