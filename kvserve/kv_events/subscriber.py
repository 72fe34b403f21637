"""Reading one replica's KV events (vLLM's or kvserve's), in order, with gaps repaired.

A thread owns a SUB socket on the replica's PUB endpoint and, if given, a DEALER socket on
its replay endpoint. When a batch's sequence number skips ahead of the last one delivered
(PUB drops what a slow subscriber cannot take; a subscriber that joins late has missed the
start), it asks the replay socket for everything from the first missing number and
delivers the replayed batches first, so `on_batch` sees sequence numbers in increasing
order. What the replica no longer buffers is lost: counted in `missed_batches`.

A sequence number lower than the last one means the replica restarted (it counts from 0
again): delivery resumes from there, and the consumer sees the number go back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from kvserve.kv_cache.events import KVCacheEvent
from kvserve.kv_events.wire import decode_batch
from kvserve.logger import logger

OnBatch = Callable[[int, float, list[KVCacheEvent]], None]  # (seq, ts, events), on the subscriber's thread
POLL_MS = 50  # how often the thread looks at its stop flag


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_batch: OnBatch,
        *,
        replay_timeout: float = 1.0,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_batch = on_batch
        self.replay_timeout = replay_timeout
        self.last_seq = -1  # the last sequence number delivered; -1 before the first
        self.last_event_time: float | None = None  # time.monotonic() of the last batch received
        self.missed_batches = 0  # skipped over mid-stream and not recovered by a replay
        self.bad_batches = 0  # not decodable (counted, skipped)
        self._topic = topic.encode()
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.set_hwm(100_000)  # as the publisher's: batches are small, a burst should not drop
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.set(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's buffer; take all of it
            self._replay.connect(replay_endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events-sub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # the subscriber's thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sub.poll(POLL_MS):
                    self._receive(self._sub.recv_multipart(zmq.NOBLOCK))
        except Exception:  # a bug: say so; the consumer sees last_event_time stop moving
            logger.exception("KV events: subscriber of %s stopped", self.endpoint)
        finally:
            self._sub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_batches += 1
            return
        topic, seq_bytes, payload = frames
        if topic != self._topic:  # SUBSCRIBE matches prefixes; the topic must be this one
            return
        seq = int.from_bytes(seq_bytes, "big")
        self.last_event_time = time.monotonic()
        if seq < self.last_seq:
            logger.info("KV events: %s restarted (seq %d after %d)", self.endpoint, seq, self.last_seq)
            self.last_seq = -1
        if seq <= self.last_seq:
            return
        if seq > self.last_seq + 1 and self._replay is not None:
            self._replay_before(seq)
        self._deliver(seq, payload)

    def _replay_before(self, seq: int) -> None:
        """Ask for the batches from last_seq + 1 on and deliver those before `seq`."""
        assert self._replay is not None
        while self._replay.poll(0):  # a late answer to an earlier request that timed out
            self._replay.recv_multipart()
        start = self.last_seq + 1
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))  # as a REQ socket would frame it
        deadline = time.monotonic() + self.replay_timeout
        while (left := deadline - time.monotonic()) > 0 and self._replay.poll(int(left * 1000) + 1):
            frames = self._replay.recv_multipart()[1:]  # drop the empty delimiter
            if not frames or not frames[-1]:  # the end marker: an empty payload
                return
            # vLLM now sends (topic, seq, payload); before, (seq, payload)
            replayed = int.from_bytes(frames[-2], "big")
            if self.last_seq < replayed < seq:
                self._deliver(replayed, frames[-1])
        logger.warning("KV events: no end of replay from %s within %.1fs", self.replay_endpoint, self.replay_timeout)

    def _deliver(self, seq: int, payload: bytes) -> None:
        missed = seq - self.last_seq - 1
        if missed and self.last_seq >= 0:
            self.missed_batches += missed
            logger.warning("KV events: %d batches from %s lost before seq %d", missed, self.endpoint, seq)
        elif missed:
            logger.info("KV events: joined %s at seq %d; earlier batches are no longer buffered", self.endpoint, seq)
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            self.bad_batches += 1
            logger.warning("KV events: batch %d from %s: %s", seq, self.endpoint, e)
            return
        try:
            self.on_batch(seq, batch.ts, batch.events)
        except Exception:  # the consumer's bug; the stream goes on
            logger.exception("KV events: on_batch failed for batch %d", seq)
