"""Prefill/decode disaggregation, the router's half: whether a request's prompt is computed on a prefill
replica first, and the bodies of the two calls (vLLM's NixlConnector shape).

Decode first, as Dynamo's and llm-d's conditional disaggregation decide: the policy picks the decode
replica (its load, what it holds); the tokens it would have to prefill there are the prompt less its
predicted cached run. At most `--max-local-prefill-tokens` (a warm turn of a chat): it prefills them
itself. More (a cold prompt): a prefill replica, chosen by the same policy over the prefill replicas,
computes the prompt with `max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true}`, holds its
blocks under a lease and answers where they are; the decode replica gets the client's own request plus
those params, pulls the blocks and streams the answer. A prefill replica that fails before answering is a
retry on another, then a local prefill: never a failed request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvserve.router.policy import Decision
from kvserve.router.request import RoutedRequest

# fields the prefill call must not carry: they ask for more than its one token, or for a stream
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "best_of")


def wants_remote_prefill(request: RoutedRequest, decode: Decision, max_local_prefill_tokens: int) -> str | None:
    """None where the decode replica should get the prompt from a prefill replica; else why it prefills it
    itself ("short": few tokens to compute there; "batch": several prompts, one handoff each is not the
    protocol's; "beam_search": a replica hands off only a sampled request's prompt; a prompt the router
    could not tokenize counts as short, its cost unknown)."""
    if len(request.prompts) != 1:
        return "batch" if request.prompts else "short"
    if request.body.get("use_beam_search"):
        return "beam_search"
    if decode.uncached_tokens <= max_local_prefill_tokens:
        return "short"
    return None


def prefill_body(request: RoutedRequest) -> dict[str, Any]:
    """The client's body, asking for the prompt's KV and one token, whole (never streamed), one choice."""
    body = copy.copy(request.body)
    for name in _NOT_FOR_PREFILL:
        body.pop(name, None)
    body["max_tokens"] = 1
    if request.kind == "chat" and "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["n"] = 1
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return body


def handoff_params(reply: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` a prefill replica answered with, if they hand blocks over (null: it could
    not hold them; anything else malformed is no handoff either: the decode replica prefills)."""
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return params  # passed on as it came: its fields (kv_path, tp_size, ...) are the replicas' business


@dataclass(frozen=True)
class Handoff:
    """How a request's prompt reaches its decode replica: `params` from a prefill replica, or None (local)."""

    params: dict[str, Any] | None = None
    prefill: Decision | None = None  # the prefill replica that computed it

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The decode call's body: the client's, plus exactly the params the prefill replica returned."""
        if self.params is None:
            return body
        return {**body, "kv_transfer_params": self.params}


LOCAL = Handoff()
