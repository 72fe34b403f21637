"""POST /tokenize and /detokenize, tokenizing as the completion and chat endpoints do."""

from __future__ import annotations

import asyncio

from kvserve.server.errors import bad_request
from kvserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kvserve.server.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = await self.encode_messages(request.messages, request.add_special_tokens)
        else:
            tokens = await self.tokenize(request.prompt, request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine.model_info.vocab_size
        if any(t >= vocab for t in request.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, request.tokens))
