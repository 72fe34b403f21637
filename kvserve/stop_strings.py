"""Stop strings over a growing text: the engine's output processor and the router's text stage
(a migrated stream) match them alike. No torch, no tokenizer: the router imports this."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], delta_len: int, include: bool) -> tuple[str, int] | None:
    """A stop string ending in the last `delta_len` characters of `text`: (it, where the text is cut)."""
    for stop in stops:
        at = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if at != -1:
            return stop, at + len(stop) if include else at
    return None


def holdback(text: str, stops: Sequence[str]) -> int:
    """How long a tail of `text` to keep back while running: it could start a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
