"""POST /v1/chat/completions: the model's chat template, then n choices, streamed or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Response

from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
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

_FIELDS = set(ChatCompletionRequest.model_fields)
_RENAME = {"prompt": "messages"}  # the engine's word for what the client sent as messages


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, tenant: str
    ) -> ChatCompletionResponse | Response:
        self.check_model(request.model)
        prompt_ids = await self.encode_messages(request.messages, request.add_special_tokens)
        max_tokens = request.requested_max_tokens
        self.check_context(len(prompt_ids), max_tokens, "messages")
        params = self.sampling_params(request, max_tokens)  # None: up to the context length
        request_id = f"chatcmpl-{random_uuid()}"
        stream = self.generate([prompt_ids], params, request_id, tenant, request.cache_salt)
        with self.engine_errors(_FIELDS, _RENAME):
            first = await anext(stream)
            if request.stream:
                return EventSourceResponse(self._stream(request, request_id, first[1], stream))
            (final,) = await collect_finals(first, stream, 1)
        return self._response(request, request_id, final)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=c.text),
                logprobs=chat_logprobs(c, slice(None), request.top_logprobs or 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if request.return_token_ids else None,
            )
            for c in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=choices,
            usage=usage([final]),
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        first: RequestOutput,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        states = {i: StreamState() for i in range(request.n)}
        final = first

        def chunk(choices: list[ChatCompletionResponseStreamChoice], prompt_ids: list[int] | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, model=self.served_model_name, choices=choices, prompt_token_ids=prompt_ids
            )
            return sse_data(response)

        def deltas(out: RequestOutput) -> list[ChatCompletionResponseStreamChoice]:
            choices = []
            for c in out.outputs:
                text, new = states[c.index].advance(c)
                logprobs = chat_logprobs(c, new, request.top_logprobs or 0)
                # with return_token_ids every token is sent when generated, its text held back or not (vLLM's)
                token_ids = c.token_ids[new] if request.return_token_ids else None
                if text or c.finish_reason or (logprobs and logprobs.content) or token_ids:
                    choices.append(
                        ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=text),
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=token_ids,
                        )
                    )
            return choices

        async with aclosing(stream):
            try:
                role = DeltaMessage(role="assistant", content="")
                roles = [ChatCompletionResponseStreamChoice(index=i, delta=role) for i in range(request.n)]
                yield chunk(roles, first.prompt_token_ids if request.return_token_ids else None)
                if choices := deltas(first):
                    yield chunk(choices)
                async for _, out in stream:
                    final = out
                    if choices := deltas(out):
                        yield chunk(choices)
                if request.include_usage:
                    yield sse_data(
                        ChatCompletionStreamResponse(
                            id=request_id, model=self.served_model_name, choices=[], usage=usage([final])
                        )
                    )
            except Exception as e:
                yield stream_error(e)
        yield DONE


def chat_logprobs(c: CompletionOutput, new: slice, top: int) -> ChatCompletionLogProbs | None:
    """The chat logprobs content of the tokens at `new`, each with its `top` most likely alternatives."""
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids[new], c.logprobs[new], strict=True):
        chosen = _logprob(entry[token_id])
        tops = [_logprob(lp) for lp in by_rank(entry)[:top]]
        content.append(ChatCompletionLogProbsContent(**chosen.model_dump(), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


def _logprob(lp: Logprob) -> ChatCompletionLogProb:
    token = lp.decoded_token or ""
    return ChatCompletionLogProb(token=token, logprob=lp.logprob, bytes=list(token.encode()))
