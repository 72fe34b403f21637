"""What a stream has sent its client, and how it goes on from another replica when it is cut.

The router asks the replica for vLLM's `return_token_ids` (dropped again before the client
sees them unless it asked), so it knows every generated token exactly, the byte pieces of a
split character too. On a cut, the continuation is a completion on another replica whose
prompt is the original prompt's token ids plus every token generated so far: nothing is
generated again, so the stream goes on as the uninterrupted one would under any sampling.

What the client has been sent ends where the replica's text stage let it go: a character
waits for its last byte, and text that may start a stop string is held back. The new
replica knows neither that text nor the stop string begun in it, so the router runs the
replica's text stage itself from there on (`TextStage`: the same incremental detokenizer
over all the tokens, then stop strings and hold-back as `engine/output_processor.py` does)
and takes only the continuation's token ids; its stop strings are the router's to match,
and a match ends the stream (the continuation's request is closed). The client's text is
thus the prefix-consistent text of exactly the tokens it is counted for.

Without a tokenizer the router cannot decode the tokens; the continuation then starts from
the original prompt again and skips the text and the tokens the client already had, which
is the same stream only under greedy decoding.

`max_tokens` and `min_tokens` shrink by the tokens kept; the chunks keep the stream's id,
chat streams are re-wrapped as chat chunks, and the final usage counts the original prompt
and every generated token.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.router.request import Kind, RoutedRequest
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.stop_strings import find_stop, holdback

# completion fields the router sets itself on a continuation; the rest of the body is kept
_REPLACED = ("messages", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs")
_REPLACED += ("echo", "n", "stream", "stream_options", "return_token_ids")
_STOPS = ("stop", "include_stop_str_in_output")  # matched by the router where it decodes the continuation


class StreamCut(Exception):
    """The upstream stream ended without [DONE], or said the replica failed."""


def upstream_body(request: RoutedRequest) -> dict[str, Any]:
    """The body sent to the replica: usage always (for the metrics), and token ids where the stream may migrate."""
    body = copy.copy(request.body)
    if request.stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if request.migratable:
        body["return_token_ids"] = True
    return body


def client_wants_logprobs(request: RoutedRequest) -> bool:
    value = request.body.get("logprobs")
    return value is not None if request.kind == "completion" else bool(value)


def client_wants_usage(request: RoutedRequest) -> bool:
    options = request.body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


@dataclass
class TextStage:
    """A replica's text stage over one stream's tokens: its detokenizer, then stop strings (looked
    for once `min_tokens` are out, never in the text of the token that ended the request) and the
    hold-back of a tail that may start one, as `engine/output_processor.py` does."""

    detokenizer: IncrementalDetokenizer
    stops: list[str]
    include_stop: bool
    min_tokens: int
    num_tokens: int = 0
    stop_reason: str | None = None
    stop_at: int | None = None  # text length to cut at, once a stop string matched

    @classmethod
    def over(cls, tokenizer: Tokenizer, body: dict[str, Any], token_ids: list[int]) -> TextStage:
        """The stage after `token_ids`, which their replica checked already (no stop string ended them)."""
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str) and s]
        detokenizer = IncrementalDetokenizer(tokenizer, body.get("skip_special_tokens", True) is not False)
        min_tokens = body.get("min_tokens") if isinstance(body.get("min_tokens"), int) else 0
        stage = cls(detokenizer, stops, body.get("include_stop_str_in_output") is True, min_tokens)
        for t in token_ids:
            stage._decode(t)
        return stage

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def add(self, token_id: int, ends_request: bool) -> None:
        delta = self._decode(token_id)
        if not ends_request and delta and self.num_tokens >= self.min_tokens:
            found = find_stop(self.text, self.stops, len(delta), self.include_stop)
            if found is not None:
                self.stop_reason, self.stop_at = found

    def released(self, finished: bool) -> str:
        """The text the replica would have let go by now."""
        if self.stop_at is not None:
            return self.text[: self.stop_at]
        return self.text if finished else self.text[: len(self.text) - holdback(self.text, self.stops)]

    def _decode(self, token_id: int) -> str:
        self.num_tokens += 1
        return self.detokenizer.step(token_id)


@dataclass
class Continuation:
    """Where the current upstream takes over."""

    base_tokens: int  # generated tokens in its prompt
    text_stage: TextStage | None  # the router's text of the stream (None: the replica's, after skip_chars)
    skip_tokens: int = 0  # without a tokenizer: its first tokens the client already had (generated again)
    skip_chars: int = 0  # and their text
    offset_base: int = 0  # completions logprobs: the client's text_offset of its first token


@dataclass
class StreamProgress:
    request: RoutedRequest
    tokenizer: RouterTokenizer | None
    wants_logprobs: bool = False
    wants_usage: bool = False
    wants_token_ids: bool = False
    id: str | None = None
    model: str | None = None
    token_ids: list[int] = field(default_factory=list)  # every token generated so far
    text: str = ""  # the text the client has been sent
    next_offset: int = 0  # completions logprobs: the client's text_offset of the next token
    finished: bool = False
    errored: bool = False  # the replica refused it mid-way (not a failure of the replica): passed on
    done: bool = False
    usage: dict[str, Any] | None = None  # the last usage the upstream reported, as the client got it
    continuation: Continuation | None = None

    def __post_init__(self) -> None:
        self.wants_logprobs = client_wants_logprobs(self.request)
        self.wants_usage = client_wants_usage(self.request)
        self.wants_token_ids = self.request.body.get("return_token_ids") is True

    @property
    def kind(self) -> Kind:
        return self.request.kind

    # reading the upstream

    def accept(self, data: str) -> list[str]:
        """One upstream `data:` payload -> what the client gets, in order; raises StreamCut on a failure."""
        if data == "[DONE]":
            if not (self.finished or self.errored) and self.request.migratable:
                raise StreamCut("[DONE] before the choice finished")
            self.done = True
            return [data]
        chunk = json.loads(data)
        if "error" in chunk:
            if chunk["error"].get("type") == "server_error":
                raise StreamCut(chunk["error"].get("message", "server error"))
            self.errored = True
            return [data]
        if self.id is None:
            self.id, self.model = chunk.get("id"), chunk.get("model")
        if chunk.get("usage") is not None and not chunk.get("choices"):
            return self._usage(chunk)
        if self.continuation is not None:
            return self._continued(chunk, self.continuation)
        if not self.wants_token_ids:
            chunk.pop("prompt_token_ids", None)  # chat's, in its first chunk
        chunk["choices"] = [c for c in (self._original(c) for c in chunk.get("choices", [])) if c is not None]
        return [_dumps(chunk)] if chunk["choices"] else []

    def _original(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """A choice of the first replica's stream: note its tokens and text, hide the ids the client did not ask."""
        if self.request.migratable:
            self.token_ids += choice.get("token_ids") or []
            self.text += _text(choice, self.kind)
            self._advance_offset(choice.get("logprobs"))
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.wants_token_ids:
            return choice
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
        if not (_text(choice, self.kind) or choice.get("finish_reason") or choice.get("logprobs")):
            if not choice.get("delta", {}).get("role"):
                return None  # it was sent only for the ids the router asked for (text held back)
        return choice

    def _advance_offset(self, logprobs: dict[str, Any] | None) -> None:
        if self.kind == "completion" and logprobs and logprobs.get("tokens"):
            self.next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def _usage(self, chunk: dict[str, Any]) -> list[str]:
        usage = chunk["usage"]
        if self.continuation is not None:
            usage = self._continued_usage(usage, self.continuation)
            chunk = {**chunk, "id": self.id, "model": self.model, "usage": usage}
            if self.kind == "chat":
                chunk["object"] = "chat.completion.chunk"
        self.usage = usage
        return [_dumps(chunk)] if self.wants_usage else []

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
        """The usage chunk of a stream that ended without its upstream's, if the client asked for one."""
        if not self.wants_usage or self.usage is not None:
            return None
        prompt, completion = self.request.num_prompt_tokens, len(self.token_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return _dumps({"id": self.id, "object": obj, "model": self.model, "choices": [], "usage": usage})

    # continuing elsewhere

    def continuation_body(self) -> dict[str, Any]:
        """The completion that goes on after every token generated so far (without a tokenizer: from the start)."""
        stage = self._text_stage()
        keep = len(self.token_ids) if stage is not None else 0
        skip_chars = 0 if stage is not None else len(self.text)
        offset_base = self.next_offset if stage is not None else 0
        self.continuation = Continuation(keep, stage, len(self.token_ids) - keep, skip_chars, offset_base)
        self.token_ids = self.token_ids[:keep]
        body = {k: v for k, v in self.request.body.items() if k not in _REPLACED}
        if stage is not None:
            body = {k: v for k, v in body.items() if k not in _STOPS}
        max_tokens = self._max_tokens()
        body["prompt"] = self.request.prompts[0] + self.token_ids
        body["max_tokens"] = None if max_tokens is None else max_tokens - keep
        if self.request.body.get("min_tokens"):
            body["min_tokens"] = max(0, self.request.body["min_tokens"] - keep)
        if self.wants_logprobs:
            body["logprobs"] = self._logprobs_asked()
        body["return_token_ids"] = True
        body["stream"], body["stream_options"] = True, {"include_usage": True}
        return body

    def _text_stage(self) -> TextStage | None:
        """The replica's text stage after the tokens so far, if the router can decode them as the replica did."""
        if self.tokenizer is None:
            return None
        stage = TextStage.over(self.tokenizer.tokenizer, self.request.body, self.token_ids)
        return stage if stage.text.startswith(self.text) else None  # else not the replica's tokenizer

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

    def _continued(self, chunk: dict[str, Any], c: Continuation) -> list[str]:
        """A continuation's completion chunk as the client's stream goes on: same id, its format, its text."""
        choices = []
        for choice in chunk.get("choices", []):
            upstream_ids = choice.get("token_ids") or []
            finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
            if c.text_stage is not None:
                ids, text, finish, stop_reason = self._decode(c.text_stage, upstream_ids, finish, stop_reason)
                drop = 0
            else:
                ids, (drop, text) = upstream_ids, _skip(c, len(upstream_ids), choice.get("text", ""))
            self.token_ids += ids
            self.text += text
            self.finished = self.finished or finish is not None
            logprobs = _shift(choice.get("logprobs"), drop, len(ids), c.offset_base) if self.wants_logprobs else None
            self._advance_offset(logprobs)
            new_ids = ids[drop:]
            if text or finish or (logprobs and logprobs["tokens"]) or (self.wants_token_ids and new_ids):
                choices.append(self._choice(text, logprobs, new_ids, finish, stop_reason))
        out = {"id": self.id, "object": "text_completion", "created": chunk.get("created"), "model": self.model}
        if self.kind == "chat":
            out["object"] = "chat.completion.chunk"
        events = [_dumps({**out, "choices": choices})] if choices else []
        if c.text_stage is not None and c.text_stage.stop_reason is not None:  # the router's stop: the end
            self.done = True
            events += [u for u in [self.final_usage()] if u is not None] + ["[DONE]"]
        return events

    def _decode(
        self, stage: TextStage, ids: list[int], finish: str | None, stop_reason: int | str | None
    ) -> tuple[list[int], str, str | None, int | str | None]:
        """The continuation's tokens through the router's text stage: those used, the new text, how it ended."""
        used = []
        for k, t in enumerate(ids):
            stage.add(t, ends_request=finish is not None and k == len(ids) - 1)
            used.append(t)
            if stage.stop_reason is not None:  # a stop string: what follows it is never the client's
                finish, stop_reason = "stop", stage.stop_reason
                break
        released = stage.released(finished=finish is not None)
        return used, released[len(self.text) :], finish, stop_reason

    def _choice(
        self,
        text: str,
        logprobs: dict[str, Any] | None,
        token_ids: list[int],
        finish: str | None,
        stop_reason: int | str | None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
            if logprobs is not None:
                choice["logprobs"] = _chat_logprobs(logprobs, self._logprobs_asked())
        else:
            choice = {"index": 0, "text": text}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        if finish is not None:
            choice["finish_reason"] = finish
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.wants_token_ids:
            choice["token_ids"] = token_ids
        return choice


def _dumps(chunk: dict[str, Any]) -> str:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def _text(choice: dict[str, Any], kind: Kind) -> str:
    if kind == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _skip(c: Continuation, num_tokens: int, text: str) -> tuple[int, str]:
    """Without a tokenizer: how many of these tokens, and which text, the client had already (greedy: the same)."""
    drop = min(c.skip_tokens, num_tokens)
    cut = min(c.skip_chars, len(text))
    c.skip_tokens -= drop
    c.skip_chars -= cut
    return drop, text[cut:]


def _shift(logprobs: dict[str, Any] | None, drop: int, end: int, base: int) -> dict[str, Any] | None:
    """Completions logprobs of tokens [drop, end), text offsets moved to the client's numbering."""
    if logprobs is None:
        return None
    return {
        "text_offset": [o + base for o in logprobs.get("text_offset", [])[drop:end]],
        "token_logprobs": logprobs.get("token_logprobs", [])[drop:end],
        "tokens": logprobs.get("tokens", [])[drop:end],
        "top_logprobs": logprobs.get("top_logprobs", [])[drop:end],
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
