"""A circuit breaker: a tier that keeps failing steps aside, then tries again by itself.

Closed: calls go through; `failure_threshold` failures in a row open it. Open: calls
are refused (a miss, at no cost) for `cooldown` seconds, doubled after each failed
probe up to `max_cooldown`. Then half-open: one call goes through as a probe; its
success closes the breaker, its failure opens it again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum


class BreakerState(IntEnum):  # values exported as the `kv_tier_breaker_state` gauge
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class CircuitBreaker:
    failure_threshold: int = 3
    cooldown: float = 1.0
    max_cooldown: float = 30.0
    clock: object = time.monotonic  # tests pass a fake clock
    _failures: int = 0
    _open_until: float = 0.0
    _next_cooldown: float = 0.0
    _probing: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._next_cooldown = self.cooldown

    @property
    def state(self) -> BreakerState:
        if self._failures < self.failure_threshold:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self.clock() < self._open_until or self._probing else BreakerState.HALF_OPEN

    def allow(self) -> bool:
        """May a call go through now? In half-open state only one caller gets True."""
        with self._lock:
            state = self.state
            if state == BreakerState.CLOSED:
                return True
            if state == BreakerState.HALF_OPEN:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._failures, self._probing, self._next_cooldown = 0, False, self.cooldown

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open_until = self.clock() + self._next_cooldown
                self._next_cooldown = min(self._next_cooldown * 2, self.max_cooldown)
                self._probing = False
