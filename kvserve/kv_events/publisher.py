"""A replica's KV events on ZMQ, as vLLM's `ZmqEventPublisher` sends them.

PUB socket: one multipart message per batch, `(topic, seq, payload)`: the topic as UTF-8
bytes, the batch's sequence number as 8 bytes big-endian (0, 1, 2, ... from the start of
the process), the msgpack batch (`wire.encode_batch`).

ROUTER replay socket: a client (vLLM's examples use REQ) sends one frame, the first
sequence number it wants, 8 bytes big-endian; it gets back, one message each, every
buffered batch from there as `(topic, seq, payload)`, then the end marker
`(b"", -1 as 8 signed bytes, b"")`. The buffer holds the last `buffer_steps` batches.

The engine thread only puts `(seq, ts, events)` on a bounded queue: encoding and sending
happen on the publisher's thread. A full queue drops the batch (counted, logged); its
sequence number is spent, so subscribers see the gap, ask for a replay, and learn that the
batch is lost rather than receiving a silently incomplete stream.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import zmq

from kvserve.kv_cache.events import KVCacheEvent
from kvserve.kv_events.wire import ENCODINGS, encode_batch
from kvserve.logger import logger

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_SECONDS = 0.02  # how long the thread waits for a batch before looking at the replay socket again


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc:// or inproc:// is bound; anything else is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def default_replay_endpoint(endpoint: str) -> str | None:
    """The replay socket beside `endpoint`: same host, port + 1 (a `*` port stays `*`); for
    ipc:// and inproc://, the name with "-replay"; None where the PUB socket connects out."""
    if not binds(endpoint):
        return None
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}-replay"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{port if port == '*' else int(port) + 1}"


def connectable(endpoint: str, host: str = "127.0.0.1") -> str:
    """A bound address as a client on another process can dial it: a wildcard host becomes `host`."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    parts = urlsplit(endpoint)
    if parts.hostname not in ("*", "0.0.0.0", "::", None):
        return endpoint
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{endpoint.rpartition(':')[2]}"


class ZmqEventPublisher:
    """Publishes KV event batches from the engine thread without ever blocking it."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        buffer_steps: int = 10_000,
        max_queue_size: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        encoding: str = "map",
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
        self.topic = topic
        self._topic = topic.encode()
        self._rank, self._encoding = data_parallel_rank, encoding
        self._queue: queue.Queue[tuple[int, float, Sequence[KVCacheEvent]] | None] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # seq order = queue order, whichever thread publishes
        self.dropped_batches = 0
        self._dropping = False
        self._closed = False
        self._pub, self._replay = self._open(endpoint, replay_endpoint, hwm, buffer_steps)
        self.endpoint = self._bound(self._pub, endpoint)
        self.replay_endpoint = self._bound(self._replay, replay_endpoint) if self._replay is not None else None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint, topic)

    def _open(
        self, endpoint: str, replay_endpoint: str | None, hwm: int, buffer_steps: int
    ) -> tuple[zmq.Socket, zmq.Socket | None]:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(hwm)
            if binds(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                # ROUTER drops what exceeds a peer's high-water mark, the end marker too: room for two replays
                replay.set(zmq.SNDHWM, max(1000, 2 * buffer_steps + 2))
                replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise OSError(f"KV events: cannot open {endpoint} / {replay_endpoint}: {e}") from e
        return pub, replay

    @staticmethod
    def _bound(socket: zmq.Socket, endpoint: str) -> str:
        """The address really bound (a `*` port resolved), or `endpoint` where the socket connected."""
        if not binds(endpoint):
            return endpoint
        return socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bool:
        """Queue one batch (from any thread); False if it was dropped (queue full, or closed)."""
        if self._closed or not events:
            return False
        ts = time.time() if ts is None else ts
        with self._lock:
            seq = next(self._seq)
            try:
                self._queue.put_nowait((seq, ts, events))
            except queue.Full:
                self._drop(seq)
                return False
        self._dropping = False
        return True

    def _drop(self, seq: int) -> None:
        self.dropped_batches += 1
        if not self._dropping:  # once per episode, not once per batch
            self._dropping = True
            logger.warning("KV events: the publisher's queue is full; dropping batches from seq %d", seq)

    def close(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT seconds), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            logger.warning("KV events: %d batches still queued at close", self._queue.qsize())
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)

    # the publisher's thread

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._pub.close(linger=100)  # ms: let the last batches reach connected subscribers
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, ts: float, events: Sequence[KVCacheEvent]) -> None:
        try:
            payload = encode_batch(ts, list(events), self._rank, self._encoding)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # one bad batch must not stop the stream; its seq becomes a gap
            logger.exception("KV events: could not send batch %d", seq)
            return
        self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            try:
                self._serve_replay(self._replay.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError as e:
                logger.warning("KV events: replay failed: %s", e)

    def _serve_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:  # [client id, empty delimiter, start seq]
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
