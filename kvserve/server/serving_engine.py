"""What the completion and chat endpoints share: model check, tokenizing, context check, generation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass

from jinja2 import TemplateError

from kvserve.engine.client import EngineClient, QueueFullError
from kvserve.kv_cache.tiers.base import SHARED_TIERS
from kvserve.logger import logger
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams
from kvserve.server.async_utils import merge_async_iterators
from kvserve.server.auth import cache_salt
from kvserve.server.errors import APIError, bad_request, value_error
from kvserve.server.kv_transfer import PullFailed, handoff_keys, pull_blocks, release_in_background
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    PromptTokenUsageInfo,
    UsageInfo,
)
from kvserve.server.sse import sse_data
from kvserve.tokenizer import apply_chat_template

RETRY_AFTER_SECONDS = 1


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        metrics: ServerMetrics,
        cache_secret: bytes,
        kv_load_failure_policy: str = "recompute",
    ):
        self.engine = engine
        self.kv_load_failure_policy = kv_load_failure_policy
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.metrics = metrics
        self._cache_secret = cache_secret
        self.max_model_len = engine.model_info.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """In a worker thread: a huge prompt must not stall the event loop."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_messages(self, messages: list[ChatCompletionMessageParam], add_special_tokens: bool) -> list[int]:
        try:
            prompt = await asyncio.to_thread(apply_chat_template, self.tokenizer, [m.to_template() for m in messages])
        except (ValueError, TemplateError) as e:  # no template, or the template refused the messages
            raise bad_request(str(e), "messages") from e
        return await self.tokenize(prompt, add_special_tokens)

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> None:
        """A 400 with the numbers when the prompt, or prompt plus max_tokens, exceeds the context."""
        if num_prompt_tokens > self.max_model_len:
            raise bad_request(
                f"{prompt_field} is {num_prompt_tokens} tokens, longer than max_model_len={self.max_model_len}",
                prompt_field,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"max_tokens={max_tokens} is too large: {num_prompt_tokens} prompt tokens + {max_tokens} > "
                f"max_model_len={self.max_model_len}",
                "max_tokens",
            )

    def sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
    ) -> SamplingParams | BeamSearchParams:
        try:
            if request.use_beam_search:  # no max_tokens: up to the context (the engine caps it)
                return request.to_beam_search_params(max_tokens or self.max_model_len)
            params = request.to_sampling_params(max_tokens)
            if request.kv_transfer_params:
                params.extra_args = {"kv_transfer_params": request.kv_transfer_params}
            return params
        except ValueError as e:
            raise value_error(e, set(type(request).model_fields)) from e

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        tenant: str,
        client_salt: str | None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt, tagged with the prompt's index, under the tenant's cache salt."""
        salt = cache_salt(self._cache_secret, tenant, client_salt)
        streams = [self._generate_one(p, params, f"{request_id}-{i}", salt, tenant) for i, p in enumerate(prompts)]
        return merge_async_iterators(*streams)

    async def _generate_one(
        self, prompt: list[int], params: SamplingParams | BeamSearchParams, request_id: str, salt: str, tenant: str
    ) -> AsyncIterator[RequestOutput]:
        transfer = (getattr(params, "extra_args", None) or {}).get("kv_transfer_params") or {}
        if transfer.get("do_remote_prefill") and transfer.get("kv_path") != "redis":
            if self.engine.replica_info.role == "decode":
                await self._pull_prefix(prompt, salt, transfer)
            else:  # no room kept for handed-off blocks: computed here, the prefill replica's lease let go
                release_in_background(transfer, self._cache_secret)
        first = True
        async with aclosing(self.engine.generate(prompt, params, request_id, cache_salt=salt)) as outputs:
            async for out in outputs:
                if out.kv_transfer_params is not None and set(SHARED_TIERS) & set(self.engine.replica_info.kv_tiers):
                    out.kv_transfer_params = await self._hand_off_through_redis(out)
                if first:
                    first = False
                    self.metrics.tenant_requests.labels(tenant).inc()
                    self.metrics.tenant_cached_tokens.labels(tenant).inc(out.num_cached_tokens)
                yield out

    async def _hand_off_through_redis(self, out: RequestOutput) -> dict:
        """A prefill replica sharing a Redis tier with the decode side: its blocks went there as
        they filled; once those writes are done, the decode replica's own lookup finds them, so
        nothing need be held here."""
        await self.engine.flush_kv()
        self.engine.release_kv(out.request_id)
        return {**out.kv_transfer_params, "kv_path": "redis"}

    async def _pull_prefix(self, prompt: list[int], salt: str, transfer: dict) -> None:
        """A decode replica: the prompt's blocks from the prefill replica that computed them,
        for this request's prefix lookup. A failed pull is computed here, or with the `fail`
        policy an error, as vLLM's --kv-load-failure-policy."""
        info = self.engine.replica_info
        keys = handoff_keys(prompt, salt, info.block_size)
        if not keys:
            return
        try:
            pulled = await pull_blocks(transfer, keys, self._cache_secret, info.kv_record_bytes)
        except PullFailed as e:
            self.metrics.kv_load_failures.inc()
            if self.kv_load_failure_policy == "fail":
                raise APIError(500, f"could not load the prompt's KV blocks: {e}", code="kv_load_failed") from e
            logger.warning("could not pull the prompt's KV blocks (%s): computing them here", e)
            return
        # every record is checksummed (a long prompt's are ~100 MB): off the event loop, which streams other tokens
        n = await asyncio.to_thread(self.engine.import_kv, keys, pulled.records)
        self.metrics.kv_transferred("received", n, pulled.nbytes, pulled.seconds)

    @contextmanager
    def engine_errors(self, fields: set[str], rename: dict[str, str] | None = None) -> Iterator[None]:
        """The engine's refusals as HTTP errors: a full queue is 429, a bad request 400."""
        try:
            yield
        except QueueFullError as e:
            raise APIError(
                429,
                f"too many requests queued ({e}); retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from e
        except ValueError as e:
            raise value_error(e, fields, {"beam_width": "n", **(rename or {})}) from e  # n is the beam width


def usage(finals: list[RequestOutput]) -> UsageInfo:
    """Usage over the final outputs of every prompt of one HTTP request."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached),
    )


async def collect_finals(
    first: tuple[int, RequestOutput], stream: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int
) -> list[RequestOutput]:
    """The last (finished) output of each prompt, in prompt order."""
    last = dict([first])
    async for i, out in stream:
        last[i] = out
    return [last[i] for i in range(num_prompts)]


@dataclass
class StreamState:
    """How much of one choice has been streamed."""

    text_len: int = 0
    num_tokens: int = 0

    def advance(self, c: CompletionOutput) -> tuple[str, slice]:
        """The text and the token positions that are new since the last call."""
        text, new = c.text[self.text_len :], slice(self.num_tokens, len(c.token_ids))
        self.text_len, self.num_tokens = len(c.text), len(c.token_ids)
        return text, new


def by_rank(entry: dict[int, Logprob]) -> list[Logprob]:
    """One token's logprob entry, most likely first."""
    return sorted(entry.values(), key=lambda lp: lp.rank)


def stream_error(e: Exception) -> str:
    """An error after the response has started: sent as an event, as vLLM does."""
    if isinstance(e, APIError):
        info = e.info
    elif isinstance(e, ValueError):
        info = ErrorInfo(message=str(e), type="invalid_request_error")
    else:
        logger.exception("error while streaming", exc_info=e)
        info = ErrorInfo(message="internal server error", type="server_error", code="internal_error")
    return sse_data(ErrorResponse(error=info))
