"""A request as the router routes it: the client's body, its tenant, its prompts' token ids and block keys.

The token ids are the replica's (`tokenizer.RouterTokenizer`, or the replica's own
`/tokenize` where local tokenization was found to differ or failed), and the block keys
are the replica's: `chain_keys` under `extra_key(cache_salt(secret, tenant, client salt))`.
A body the router cannot read is still forwarded (the replica answers with its 400),
just without a cache score.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import jinja2
from pydantic import TypeAdapter, ValidationError

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.logger import logger
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.server.auth import cache_salt
from kvserve.server.protocol import ChatCompletionMessageParam

Kind = Literal["completion", "chat"]
_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
# (the caller's Authorization header, the payload for POST /tokenize) -> token ids, or None if refused
RemoteTokenize = Callable[[str | None, dict[str, Any]], Awaitable[list[int] | None]]
# A prompt shorter than this (~1 ms to encode) is tokenized on the event loop: a worker thread
# would wait for the GIL behind the streams the loop relays, up to its 5 ms switch interval.
INLINE_TOKENIZE_CHARS = 2_000


@dataclass
class RoutedRequest:
    kind: Kind
    body: dict[str, Any]
    tenant: str
    authorization: str | None  # forwarded as it came
    prompts: list[list[int]] = field(default_factory=list)  # token ids per prompt; empty where unknown
    keys: list[list[bytes]] = field(default_factory=list)  # chained block keys of each prompt's full blocks
    arrived: float = field(default_factory=time.monotonic)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def migratable(self) -> bool:
        """A stream that can continue on another replica: one prompt, one choice, its ids known, no echo."""
        return self.stream and len(self.prompts) == 1 and self.body.get("n", 1) == 1 and not self.body.get("echo")


@dataclass
class Tokenization:
    """Local where it was checked to match the replicas, else the replica's /tokenize."""

    tokenizer: RouterTokenizer | None = None
    local: bool = False
    remote: RemoteTokenize | None = None
    on_fallback: Callable[[], None] = lambda: None  # a prompt goes to a replica's /tokenize (a metric counts it)

    async def prompts(self, kind: Kind, body: dict[str, Any], authorization: str | None) -> list[list[int]]:
        try:
            special = _add_special_tokens(body, default=kind != "chat")
            if kind == "chat":
                messages = [m.to_template() for m in _MESSAGES.validate_python(body.get("messages"))]
                return [await self._chat(messages, special, authorization)]
            return [await self._text(p, special, authorization) if isinstance(p, str) else p for p in _prompts(body)]
        except (ValidationError, ValueError, TypeError, LookupError):
            return []  # not a valid request: the replica says why

    async def _text(self, text: str, special: bool, authorization: str | None) -> list[int]:
        if self.local and self.tokenizer is not None:
            return await _off_loop_if_long(partial(self.tokenizer.encode, add_special_tokens=special), text, len(text))
        self.on_fallback()
        return await self._remote(authorization, {"prompt": text, "add_special_tokens": special})

    async def _chat(self, messages: list[dict[str, str]], special: bool, authorization: str | None) -> list[int]:
        if self.local and self.tokenizer is not None:
            try:
                chars = sum(len(str(v)) for m in messages for v in m.values())
                encode = partial(self.tokenizer.encode_chat, add_special_tokens=special)
                return await _off_loop_if_long(encode, messages, chars)
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                logger.info("router: chat template failed locally (%s); asking a replica", type(e).__name__)
        self.on_fallback()
        return await self._remote(authorization, {"messages": messages, "add_special_tokens": special})

    async def _remote(self, authorization: str | None, payload: dict[str, Any]) -> list[int]:
        ids = await self.remote(authorization, payload) if self.remote is not None else None
        if ids is None:
            raise ValueError("no replica tokenized it")
        return ids


async def _off_loop_if_long(encode: Callable[[Any], list[int]], prompt: Any, chars: int) -> list[int]:
    return encode(prompt) if chars < INLINE_TOKENIZE_CHARS else await asyncio.to_thread(encode, prompt)


def _add_special_tokens(body: dict[str, Any], default: bool) -> bool:
    """The request's `add_special_tokens`, with the replica's default (a text prompt's yes, chat's no)."""
    special = body.get("add_special_tokens", default)
    if not isinstance(special, bool):
        raise ValueError("add_special_tokens is not a boolean")
    return special


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt` as the replica reads it: a string, token ids, or a list of either."""
    p = body["prompt"]
    if isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        return list(p)
    raise ValueError("not a prompt")


def client_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def block_keys(
    prompts: list[list[int]], block_size: int, secret: bytes, tenant: str, salt: str | None
) -> list[list[bytes]]:
    """Each prompt's keys exactly as a replica computes them for this tenant."""
    key = extra_key(cache_salt(secret, tenant, salt))
    return [chain_keys(b"", ids, block_size, key) for ids in prompts]
