"""Server-sent events: `data: <json>` lines, `data: [DONE]` at the end."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

DONE = "data: [DONE]\n\n"


def sse_data(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


class EventSourceResponse(StreamingResponse):
    """Closes its generator however the stream ends, so a client that left aborts its requests at once."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
