"""Async plumbing: merging the output streams of several prompts, and aborting on client disconnect."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request, Response

T = TypeVar("T")
_DONE = object()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of all iterators as they come, tagged with the iterator's index.

    Closing the merged iterator (or an error in one input) closes every input, so
    each engine request behind them is aborted at once.
    """
    if len(iterators) == 1:  # the usual request: no pump task and queue hop for every token
        async with aclosing(iterators[0]) as it:
            async for item in it:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async with aclosing(it):
                async for item in it:
                    await queue.put((i, item))
            await queue.put((i, _DONE))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def listen_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Cancel the handler (aborting its engine requests) if the client goes away before it returns.

    The route must take `raw_request: Request`. A streaming response is handed back
    as soon as its first output is ready; from then on the response watches the connection.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        request: Request = kwargs["raw_request"]
        work = asyncio.ensure_future(handler(*args, **kwargs))
        watch = asyncio.ensure_future(listen_for_disconnect(request))
        try:
            done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # the client left (or the server is shutting down)
        if work in done:
            return work.result()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    return wrapper
