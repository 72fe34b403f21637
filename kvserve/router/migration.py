"""What a stream has sent its client, and how it goes on from another replica when it is cut.

The router asks for each token's logprob entry (`logprobs: 0`, dropped again before the
client sees it unless it asked), which names the token; the tokenizer maps that text back
to its id where only one token reads so (not the byte pieces of a split character). On a
cut, the continuation is a completion on another replica whose prompt is the original
prompt's token ids plus the generated tokens up to the last clean boundary: the last token
after which the client has been sent exactly the text so far. Tokens after it (text the
replica was holding back: half a character, the start of a possible stop string) are
generated again, so the new replica's detokenizer and stop-string matching start where
the client's text ends. Their text and logprobs, already sent, are skipped; greedy
decoding makes them the same tokens, so the whole text equals an uninterrupted run's.

`max_tokens` and `min_tokens` shrink by the tokens kept; the chunks keep the stream's id,
chat streams are re-wrapped as chat chunks, and the final usage counts the original prompt
and every generated token.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.router.request import Kind, RoutedRequest
from kvserve.router.tokenizer import RouterTokenizer

# completion fields the router sets itself on a continuation; the rest of the body is kept
_REPLACED = ("messages", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs")
_REPLACED += ("echo", "n", "stream", "stream_options")


class StreamCut(Exception):
    """The upstream stream ended without [DONE], or said the replica failed."""


def upstream_body(request: RoutedRequest) -> dict[str, Any]:
    """The body sent to the replica: usage always (for the metrics), and logprobs where the stream may migrate."""
    body = copy.copy(request.body)
    if request.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if request.migratable:
        if request.kind == "completion" and body.get("logprobs") is None:
            body["logprobs"] = 0
        elif request.kind == "chat" and not body.get("logprobs") and "top_logprobs" not in body:
            body["logprobs"], body["top_logprobs"] = True, 0
    return body


def client_wants_logprobs(request: RoutedRequest) -> bool:
    value = request.body.get("logprobs")
    return value is not None if request.kind == "completion" else bool(value)


def client_wants_usage(request: RoutedRequest) -> bool:
    options = request.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


@dataclass
class Continuation:
    """Where the current upstream takes over (all zero before any migration)."""

    base_tokens: int = 0  # generated tokens in its prompt
    text_base: int = 0  # length of their text
    skip_tokens: int = 0  # its first tokens the client already had (generated again)
    skip_chars: int = 0  # and their text


@dataclass
class StreamProgress:
    request: RoutedRequest
    tokenizer: RouterTokenizer | None
    wants_logprobs: bool = False
    wants_usage: bool = False
    id: str | None = None
    model: str | None = None
    token_ids: list[int | None] = field(default_factory=list)  # generated so far (None: not known exactly)
    text: str = ""  # the text the client has been sent
    tokens_seen: int = 0  # tokens the client has had (their logprob entries, if it asked)
    finished: bool = False
    errored: bool = False  # the replica refused it mid-way (not a failure of the replica): passed on
    done: bool = False
    usage: dict[str, Any] | None = None  # the last usage the upstream reported, as the client got it
    continuation: Continuation | None = None

    def __post_init__(self) -> None:
        self.wants_logprobs = client_wants_logprobs(self.request)
        self.wants_usage = client_wants_usage(self.request)

    @property
    def kind(self) -> Kind:
        return self.request.kind

    # reading the upstream

    def accept(self, data: str) -> str | None:
        """One upstream `data:` payload -> what the client gets (None: nothing); raises StreamCut on a failure."""
        if data == "[DONE]":
            if not (self.finished or self.errored) and self.request.migratable:
                raise StreamCut("[DONE] before the choice finished")
            self.done = True
            return data
        chunk = json.loads(data)
        if "error" in chunk:
            if chunk["error"].get("type") == "server_error":
                raise StreamCut(chunk["error"].get("message", "server error"))
            self.errored = True
            return data
        if self.id is None:
            self.id, self.model = chunk.get("id"), chunk.get("model")
        if chunk.get("usage") is not None and not chunk.get("choices"):
            return self._usage(chunk)
        if self.continuation is not None:
            chunk = self._rewrap(chunk, self.continuation)
        else:
            chunk["choices"] = [c for c in (self._original(c) for c in chunk.get("choices", [])) if c is not None]
        if not chunk["choices"]:
            return None
        return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))

    def _original(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """A choice of the first replica's stream: note its tokens and text, hide what the client did not ask."""
        entries = _entries(choice, self.kind)
        if self.request.migratable:
            self.token_ids += [self._token_id(e) for e in entries]
            self.tokens_seen += len(entries)
            self.text += _text(choice, self.kind)
        if choice.get("finish_reason") is not None:
            self.finished = True
        if not self.wants_logprobs:
            choice.pop("logprobs", None)
            if not (_text(choice, self.kind) or choice.get("finish_reason") or choice.get("delta", {}).get("role")):
                return None  # it was sent only for the logprob the router asked for
        return choice

    def _token_id(self, entry: dict[str, Any]) -> int | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.token_id(entry.get("token", ""))

    def _usage(self, chunk: dict[str, Any]) -> str | None:
        usage = chunk["usage"]
        if self.continuation is not None:
            usage = self._continued_usage(usage, self.continuation)
            chunk = {**chunk, "id": self.id, "model": self.model, "usage": usage}
            if self.kind == "chat":
                chunk["object"] = "chat.completion.chunk"
        self.usage = usage
        return json.dumps(chunk, ensure_ascii=False, separators=(",", ":")) if self.wants_usage else None

    def _continued_usage(self, usage: dict[str, Any], c: Continuation) -> dict[str, Any]:
        prompt = self.request.num_prompt_tokens
        completion = c.base_tokens + usage.get("completion_tokens", 0)
        cached = min(prompt, (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def final_usage(self) -> str | None:
        """The usage chunk of a stream cut after its last token, if the client asked for one it did not get."""
        if not self.wants_usage or self.usage is not None:
            return None
        prompt, completion = self.request.num_prompt_tokens, self.tokens_seen
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {"id": self.id, "object": obj, "model": self.model, "choices": [], "usage": usage}
        return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))

    # continuing elsewhere

    def continuation_body(self) -> dict[str, Any]:
        """The completion that goes on from the last clean boundary; updates what is skipped and kept."""
        keep, text_len = self._clean_boundary()
        self.continuation = Continuation(keep, text_len, self.tokens_seen - keep, len(self.text) - text_len)
        self.token_ids = self.token_ids[:keep]
        body = {k: v for k, v in self.request.body.items() if k not in _REPLACED}
        max_tokens = self._max_tokens()
        body["prompt"] = self.request.prompts[0] + list(self.token_ids)
        body["max_tokens"] = None if max_tokens is None else max_tokens - keep
        if self.request.body.get("min_tokens"):
            body["min_tokens"] = max(0, self.request.body["min_tokens"] - keep)
        body["logprobs"] = self._logprobs_asked() if self.wants_logprobs else 0
        body["stream"], body["stream_options"] = True, {"include_usage": True}
        return body

    def _clean_boundary(self) -> tuple[int, int]:
        """The most tokens (and their text length) whose text is exactly a prefix of what the client got,
        ending on a token that completed its text (not the first byte of a character)."""
        known = []
        for t in self.token_ids:
            if t is None:
                break
            known.append(t)
        if self.tokenizer is None or not known:
            return 0, 0
        skip_special = self.request.body.get("skip_special_tokens", True) is not False
        keep, text_len, at = 0, 0, 0
        for i, piece in enumerate(self.tokenizer.decoded_texts(known, skip_special)):
            if not self.text.startswith(piece, at):
                break
            at += len(piece)
            if piece:
                keep, text_len = i + 1, at
        return keep, text_len

    def _max_tokens(self) -> int | None:
        body = self.request.body
        if self.kind == "chat":
            value = body.get("max_completion_tokens", body.get("max_tokens"))
            return value if isinstance(value, int) else None
        return body["max_tokens"] if "max_tokens" in body else 16  # the completions default

    def _logprobs_asked(self) -> int:
        if self.kind == "chat":
            return self.request.body.get("top_logprobs") or 0
        return self.request.body.get("logprobs") or 0

    def _rewrap(self, chunk: dict[str, Any], c: Continuation) -> dict[str, Any]:
        """A continuation's completion chunk as the client's stream goes on: same id, its format, skips applied."""
        choices = []
        for choice in chunk.get("choices", []):
            entries = _entries(choice, "completion")
            self.token_ids += [self._token_id(e) for e in entries]
            drop = min(c.skip_tokens, len(entries))
            c.skip_tokens -= drop
            self.tokens_seen += len(entries) - drop
            text = choice.get("text", "")
            cut = min(c.skip_chars, len(text))
            c.skip_chars -= cut
            text = text[cut:]
            self.text += text
            logprobs = _shift(choice.get("logprobs"), drop, c.text_base) if self.wants_logprobs else None
            if choice.get("finish_reason") is not None:
                self.finished = True
            if text or choice.get("finish_reason") or (logprobs and logprobs["tokens"]):
                choices.append(self._choice(text, logprobs, choice))
        out = {"id": self.id, "object": "text_completion", "created": chunk.get("created"), "model": self.model}
        if self.kind == "chat":
            out["object"] = "chat.completion.chunk"
        return {**out, "choices": choices}

    def _choice(self, text: str, logprobs: dict[str, Any] | None, upstream: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
            if logprobs is not None:
                choice["logprobs"] = _chat_logprobs(logprobs, self._logprobs_asked())
        else:
            choice = {"index": 0, "text": text}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        for key in ("finish_reason", "stop_reason"):
            if upstream.get(key) is not None:
                choice[key] = upstream[key]
        return choice


def _text(choice: dict[str, Any], kind: Kind) -> str:
    if kind == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _entries(choice: dict[str, Any], kind: Kind) -> list[dict[str, Any]]:
    """The chunk's tokens as {"token": text} entries, from its logprobs."""
    logprobs = choice.get("logprobs") or {}
    if kind == "chat":
        return logprobs.get("content") or []
    return [{"token": t} for t in logprobs.get("tokens") or []]


def _shift(logprobs: dict[str, Any] | None, drop: int, base: int) -> dict[str, Any] | None:
    """Completions logprobs without their first `drop` tokens, text offsets moved to the client's text."""
    if logprobs is None:
        return None
    return {
        "text_offset": [o + base for o in logprobs.get("text_offset", [])[drop:]],
        "token_logprobs": logprobs.get("token_logprobs", [])[drop:],
        "tokens": logprobs.get("tokens", [])[drop:],
        "top_logprobs": logprobs.get("top_logprobs", [])[drop:],
    }


def _chat_logprobs(logprobs: dict[str, Any], top: int) -> dict[str, Any]:
    """Completions logprobs as chat's: each token with its bytes and its `top` most likely alternatives."""
    content = []
    for token, lp, tops in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        alternatives = list((tops or {}).items())[:top]
        content.append(
            {
                "token": token,
                "logprob": lp,
                "bytes": list(token.encode()),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alternatives],
            }
        )
    return {"content": content}
