"""POST /v1/completions: one set of n choices per prompt, streamed or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from fastapi import Response

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from kvserve.server.serving_engine import (
    OpenAIServing,
    StreamState,
    by_rank,
    collect_finals,
    random_uuid,
    stream_error,
    usage,
)
from kvserve.server.sse import DONE, EventSourceResponse, sse_data

_FIELDS = set(CompletionRequest.model_fields)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, tenant: str) -> CompletionResponse | Response:
        self.check_model(request.model)
        prompts = request.prompts()
        prompt_ids = [p if isinstance(p, list) else await self.tokenize(p, request.add_special_tokens) for p in prompts]
        for ids in prompt_ids:
            self.check_context(len(ids), request.max_tokens, "prompt")
        params = self.sampling_params(request, request.max_tokens)
        request_id = f"cmpl-{random_uuid()}"
        stream = self.generate(prompt_ids, params, request_id, tenant, request.cache_salt)
        with self.engine_errors(_FIELDS):
            first = await anext(stream)  # errors before the first token are still HTTP errors
            # decoded once the engine has accepted the token ids (out-of-vocab ids are its 400)
            echoes = [await self._echo_text(p) for p in prompts] if request.echo else None
            if request.stream:
                return EventSourceResponse(self._stream(request, request_id, first, stream, echoes))
            finals = await collect_finals(first, stream, len(prompts))
        if request.echo_without_generation:
            finals = [without_generation(out) for out in finals]
        return self._response(request, request_id, finals, echoes)

    async def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else await asyncio.to_thread(self.tokenizer.decode, prompt)

    def _response(
        self, request: CompletionRequest, request_id: str, finals: list[RequestOutput], echoes: list[str] | None
    ) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                logprobs = None
                if c.logprobs is not None:
                    logprobs, offset = self._prompt_part(request, out)
                    logprobs = _join(logprobs, completion_logprobs(c, slice(None), offset)[0])
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + c.index,
                        text=(echoes[i] if echoes else "") + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None,
                        token_ids=c.token_ids if request.return_token_ids else None,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=usage(finals),
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        first: tuple[int, RequestOutput],
        stream: AsyncIterator[tuple[int, RequestOutput]],
        echoes: list[str] | None,
    ) -> AsyncIterator[str]:
        states: dict[int, StreamState] = {}
        offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        prompt_sent: set[int] = set()  # choices whose first chunk went out (with the prompt's ids, if asked)
        finals: dict[int, RequestOutput] = {}

        def chunk(i: int, out: RequestOutput) -> str | None:
            choices = []
            prompt_ids = out.prompt_token_ids if request.return_token_ids else None
            if request.echo_without_generation:
                out = without_generation(out)
            for c in out.outputs:
                index = i * request.n + c.index
                first_chunk = index not in states
                echo = echoes[i] if echoes and first_chunk else ""
                text, new = states.setdefault(index, StreamState()).advance(c)
                logprobs = None
                if c.logprobs is not None:
                    head = None
                    if first_chunk:  # the prompt's logprobs go out with its echo
                        head, offsets[index] = self._prompt_part(request, out)
                    logprobs, offsets[index] = completion_logprobs(c, new, offsets.get(index, 0))
                    logprobs = _join(head, logprobs)
                # with return_token_ids every token is sent when generated, its text held back or not (vLLM's)
                token_ids = c.token_ids[new] if request.return_token_ids else None
                if echo or text or c.finish_reason or (logprobs and logprobs.tokens) or token_ids:
                    choices.append(
                        CompletionResponseChoice(
                            index=index,
                            text=echo + text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            prompt_token_ids=None if index in prompt_sent else prompt_ids,
                            token_ids=token_ids,
                        )
                    )
                    prompt_sent.add(index)
            if out.finished:
                finals[i] = out
            if not choices:
                return None
            return sse_data(CompletionStreamResponse(id=request_id, model=self.served_model_name, choices=choices))

        async with aclosing(stream):
            try:
                if data := chunk(*first):
                    yield data
                async for i, out in stream:
                    if data := chunk(i, out):
                        yield data
                if request.include_usage:
                    final_usage = usage([finals[i] for i in sorted(finals)])
                    yield sse_data(
                        CompletionStreamResponse(
                            id=request_id, model=self.served_model_name, choices=[], usage=final_usage
                        )
                    )
            except Exception as e:
                yield stream_error(e)
        yield DONE

    def _prompt_part(self, request: CompletionRequest, out: RequestOutput) -> tuple[CompletionLogProbs | None, int]:
        """With echo, the prompt's tokens' logprobs, which come before the generated ones; and
        the text offset after them."""
        if not request.echo or out.prompt_logprobs is None:
            return None, 0
        result, offset = CompletionLogProbs(), 0
        for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            if entry is None:  # the first token: nothing before it to score it
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                token = entry[token_id].decoded_token or ""
                result.token_logprobs.append(entry[token_id].logprob)
                result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in by_rank(entry)})
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result, offset


def without_generation(out: RequestOutput) -> RequestOutput:
    """`echo` with `max_tokens: 0`: the one token sampled is left out of the text, the
    logprobs and the usage, as vLLM does."""
    empty = [
        replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [], cumulative_logprob=None)
        for c in out.outputs
    ]
    return replace(out, outputs=empty)


def _join(head: CompletionLogProbs | None, tail: CompletionLogProbs) -> CompletionLogProbs:
    if head is None:
        return tail
    return CompletionLogProbs(
        text_offset=head.text_offset + tail.text_offset,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


def completion_logprobs(c: CompletionOutput, new: slice, offset: int) -> tuple[CompletionLogProbs, int]:
    """OpenAI's completions logprobs for the tokens at `new`; also returns the next token's text offset."""
    assert c.logprobs is not None
    result = CompletionLogProbs()
    for token_id, entry in zip(c.token_ids[new], c.logprobs[new], strict=True):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in by_rank(entry)})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset
