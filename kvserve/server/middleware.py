"""ASGI middleware: a cap on the request body size (413 beyond it)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_response
from kvserve.server.protocol import ErrorInfo


class BodySizeLimit:
    """Reads the body up to `max_bytes` before the app sees it; a larger one is refused with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        info = ErrorInfo(
            message=f"the request body is larger than {self.max_bytes} bytes",
            type="invalid_request_error",
            code="request_too_large",
        )
        await error_response(413, info)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands over the buffered body once, then listens to the connection again."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
