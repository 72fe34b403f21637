"""Prefill/decode handoff over HTTP, in vLLM's `kv_transfer_params` shape.

A prefill replica answers a request with `do_remote_decode` after its prompt is computed,
holding the prompt's blocks under a lease, and returns where they are (`do_remote_prefill`,
`remote_host`, `remote_port`, `remote_request_id`, `remote_block_ids`). The decode replica
given those params pulls the blocks from `POST /kv_transfer/pull` before it admits the
request, so its prefix lookup finds them (the handoff tier, `kv_cache/tiers/handoff.py`).
Where the prefill replica has a Redis tier, the blocks go through it instead: written as
they fill, flushed before the answer (`"kv_path": "redis"`), and found there by the decode
replica's own lookup, so nothing is held and nothing is pulled.

A pull names the blocks by the chained keys the decode replica computes itself under the
caller's salt, not by the ids it was handed: the prefill replica serves only the leading
run equal to its lease's keys, so a request of another tenant gets none. The pull is
authenticated by an HMAC of the request id under the cache secret, which every replica of
one deployment shares (they derive the same salts from it). Blocks travel as the tiers'
records (namespace, key, shape, checksum): bytes as stored, checked on arrival.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from kvserve.engine.client import EngineClient
from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers.pages import BufferPool
from kvserve.logger import logger
from kvserve.server.errors import APIError

TOKEN_HEADER = "X-KV-Transfer-Token"
PULL_TIMEOUT = 30.0
RELEASE_TIMEOUT = 5.0
RECEIVE_BUFFER = 16 << 20  # a larger socket buffer: fewer, larger reads of a pull's body
_bodies = BufferPool()  # pulls' bodies, each taken by its blocks' lookup or dropped from the handoff tier

router = APIRouter()


class PullRequest(BaseModel):
    remote_request_id: str
    block_keys: list[str] = Field(description="hex chained keys, as the decode replica computed them")
    release: bool = Field(True, description="drop the lease once the blocks are read")


class ReleaseRequest(BaseModel):
    remote_request_id: str


def transfer_token(secret: bytes, request_id: str) -> str:
    return hmac.new(secret, b"kvserve-kv-transfer\0" + request_id.encode(), hashlib.sha256).hexdigest()


def _check_token(raw_request: Request, request_id: str) -> None:
    expected = transfer_token(raw_request.app.state.cache_secret, request_id)
    if not hmac.compare_digest(raw_request.headers.get(TOKEN_HEADER, ""), expected):
        raise APIError(403, "kv_transfer: bad or missing transfer token", code="invalid_transfer_token")


@router.post("/kv_transfer/pull", response_class=Response)
async def pull(body: PullRequest, raw_request: Request) -> Response:
    """The records of the leased blocks under these keys, concatenated (none: an empty body)."""
    _check_token(raw_request, body.remote_request_id)
    try:
        keys = [bytes.fromhex(k) for k in body.block_keys]
    except ValueError as e:
        raise APIError(400, f"block_keys must be hex strings: {e}", param="block_keys") from e
    start = time.perf_counter()
    engine: EngineClient = raw_request.app.state.engine
    data = await engine.export_kv(body.remote_request_id, keys, body.release)
    blocks = len(data) // engine.replica_info.kv_record_bytes
    raw_request.app.state.metrics.kv_transferred("sent", blocks, len(data), time.perf_counter() - start)
    return Response(data, media_type="application/octet-stream", headers={"X-KV-Blocks": str(blocks)})


@router.post("/kv_transfer/release")
async def release(body: ReleaseRequest, raw_request: Request) -> dict[str, bool]:
    _check_token(raw_request, body.remote_request_id)
    raw_request.app.state.engine.release_kv(body.remote_request_id)
    return {"released": True}


def handoff_params(params: dict[str, Any], engine_id: str, host: str, port: int) -> dict[str, Any]:
    """A prefill replica's answer: the engine's part and where to pull from."""
    return {**params, "remote_engine_id": engine_id, "remote_host": host, "remote_port": port, "tp_size": 1}


def handoff_keys(prompt: list[int], salt: str | None, block_size: int) -> list[bytes]:
    """The chained keys of the blocks a decode replica loads (the last prompt token is recomputed)."""
    usable = (len(prompt) - 1) // block_size
    return chain_keys(b"", prompt[: usable * block_size], block_size, extra_key(salt))


class PullFailed(RuntimeError):
    """The prefill replica could not be reached, refused, or sent something unreadable."""


def _endpoint(params: dict[str, Any]) -> tuple[str, str]:
    """The lease's request id and the prefill replica's base URL, from its `kv_transfer_params`."""
    try:
        request_id, host, port = str(params["remote_request_id"]), params["remote_host"], int(params["remote_port"])
    except (KeyError, TypeError, ValueError) as e:
        raise PullFailed(f"kv_transfer_params lacks {e}") from e
    return request_id, f"http://{host}:{port}"


async def release_lease(params: dict[str, Any], secret: bytes) -> None:
    """Frees a lease no decode replica will pull (its request aborted or failed first) now, not when it
    runs out. Best effort: a prefill replica that cannot be told still frees the blocks at expiry."""
    try:
        request_id, base = _endpoint(params)
        headers = {TOKEN_HEADER: transfer_token(secret, request_id)}
        body = {"remote_request_id": request_id}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT)) as session:
            async with session.post(f"{base}/kv_transfer/release", json=body, headers=headers) as r:
                await r.read()
    except (PullFailed, aiohttp.ClientError, TimeoutError) as e:
        logger.info("could not release a KV lease (%s): it expires instead", e)


_releasing: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks


def release_in_background(params: dict[str, Any], secret: bytes) -> None:
    """`release_lease` without waiting for it: called as a request is cancelled or given up."""
    task = asyncio.ensure_future(release_lease(params, secret))
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)


@dataclass
class Pulled:
    records: list[memoryview]
    nbytes: int
    seconds: float


async def pull_blocks(params: dict[str, Any], keys: list[bytes], secret: bytes, record_bytes: int) -> Pulled:
    """The records of `keys`' leading run from the prefill replica `params` names; the lease is released."""
    request_id, base = _endpoint(params)
    body = {"remote_request_id": request_id, "block_keys": [k.hex() for k in keys], "release": True}
    headers = {TOKEN_HEADER: transfer_token(secret, request_id), "Content-Type": "application/json"}
    start = time.perf_counter()
    try:
        data = await asyncio.to_thread(_fetch, base, json.dumps(body).encode(), headers, len(keys) * record_bytes)
    except (asyncio.CancelledError, PullFailed):  # left or failed: the pull that releases may not have arrived
        release_in_background(params, secret)
        raise
    if len(data) % record_bytes:
        raise PullFailed(f"{len(data)} bytes is no whole number of {record_bytes}-byte records")
    records = [data[i : i + record_bytes] for i in range(0, len(data), record_bytes)]  # views: no copy
    return Pulled(records, len(data), time.perf_counter() - start)


def _fetch(base: str, body: bytes, headers: dict[str, str], expect: int) -> memoryview:
    """POST /kv_transfer/pull, the answer read straight from the socket into one buffer. On a thread, with
    a blocking socket: the event loop's streams move a body of ~100 MB at half the rate (their chunks, a
    copy to join them, the engine thread's share of the GIL between them). The buffer for the `expect`
    bytes asked for is found (or mapped) while the prefill replica reads its blocks out."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=PULL_TIMEOUT)
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        conn.request("POST", "/kv_transfer/pull", body=body, headers=headers)
        buffer = _bodies.take(expect)
        response = conn.getresponse()
        if response.status != 200:
            raise PullFailed(f"HTTP {response.status}: {response.read(200)!r}")
        size = int(response.getheader("Content-Length") or 0)
        data, got = (buffer[:size] if size <= expect else _bodies.take(size)), 0
        while got < len(data):
            n = response.readinto(data[got:])
            if not n:
                raise PullFailed(f"the body ended after {got} of {len(data)} bytes")
            got += n
        return data
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise PullFailed(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
