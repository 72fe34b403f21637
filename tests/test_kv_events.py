"""KV events out of a replica in vLLM's wire format, read with plain pyzmq + msgpack the way
vLLM's consumers do; gaps repaired by replay; no salt and, by default, no token ids on the
wire. Also the replica's other router-facing surface: unknown request fields, /server_info.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from test_server_common import TINY_ARGS, ServerThread, error_of

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_events.publisher import ZmqEventPublisher, connectable, default_replay_endpoint
from kvserve.kv_events.subscriber import KVEventSubscriber
from kvserve.kv_events.wire import decode_batch, encode_batch
from kvserve.logger import logger
from kvserve.sampling_params import SamplingParams

BS = 4
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
LOCAL = "tcp://127.0.0.1:*"  # a free port for each socket
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

# msgspec's encoding of vLLM's structs (vllm/distributed/kv_events.py, KVEventBatch) for
# [1.5, [BlockStored([h1, h2], None, [7, 300], 2, None, "GPU", None), BlockStored([h2], h1, [], 2, None,
# "CPU", None), BlockRemoved([h1], "STORAGE"), AllBlocksCleared()], 0], h1 = bytes(range(32)), h2 = the next 32
GOLDEN = bytes.fromhex(
    "93cb3ff80000000000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c420000102030405"
    "060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fc420202122232425262728292a2b2c2d2e2f303132333435"
    "363738393a3b3c3d3e3fb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739207cd012caa626c6f636b"
    "5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53"
    "746f726564ac626c6f636b5f68617368657391c420202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c"
    "3d3e3fb1706172656e745f626c6f636b5f68617368c420000102030405060708090a0b0c0d0e0f101112131415161718191a"
    "1b1c1d1e1fa9746f6b656e5f69647390aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c"
    "6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420000102030405"
    "060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa66d656469756da753544f5241474581a474797065b0416c"
    "6c426c6f636b73436c656172656400"
)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def engine(model_dir: Path, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("kv_events_endpoint", LOCAL)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=BS, **kwargs))


def run(eng: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> None:
    for p in prompts:
        eng.add_request(p, GREEDY, cache_salt=salt)
    while eng.has_unfinished_requests():
        eng.step()


def wait_empty(pub: ZmqEventPublisher) -> None:
    deadline = time.monotonic() + 5
    while pub._queue.qsize():
        assert time.monotonic() < deadline, "the publisher's thread does not take batches"
        time.sleep(0.005)


def replay(pub: ZmqEventPublisher, start: int = 0) -> list[list[bytes]]:
    """Every batch the publisher buffered from `start` on, as (topic, seq, payload), asked for with
    plain pyzmq: a DEALER socket framed as a REQ one (an empty delimiter, then 8 bytes big-endian)."""
    wait_empty(pub)  # each batch taken off the queue is sent, so buffered, before a replay is served
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(pub.replay_endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while sock.poll(2000):
            empty, *frames = sock.recv_multipart()
            assert empty == b""
            if frames == [b"", (-1).to_bytes(8, "big", signed=True), b""]:  # the end marker
                return out
            out.append(frames)
        raise AssertionError("no end of replay")
    finally:
        sock.close(linger=0)


def raw_events(pub: ZmqEventPublisher) -> list[dict]:
    """The events of every batch, decoded with msgpack alone, checking the framing on the way."""
    events = []
    for i, (topic, seq, payload) in enumerate(replay(pub)):
        assert topic == pub.topic.encode() and seq == i.to_bytes(8, "big")
        ts, batch, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        events += batch
    return events


def test_wire_bytes_are_msgspecs_encoding_of_vllms_structs():
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    events = [
        BlockStored([h1, h2], None, [7, 300], 2),
        BlockStored([h2], h1, [], 2, medium="CPU"),
        BlockRemoved([h1], medium="STORAGE"),
        AllBlocksCleared(),
    ]
    assert encode_batch(1.5, events) == GOLDEN
    assert decode_batch(GOLDEN).events == events
    legacy = msgpack.unpackb(encode_batch(1.5, events, encoding="array"))  # vLLM before #42892
    assert legacy[1][0] == ["BlockStored", [h1, h2], None, [7, 300], 2, None, "GPU", None]
    assert legacy[1][2:] == [["BlockRemoved", [h1], "STORAGE"], ["AllBlocksCleared"]]
    assert decode_batch(msgpack.packb(legacy)).events == events


def test_a_replica_publishes_its_blocks_in_vllms_schema(tiny_model_dir):
    eng = engine(tiny_model_dir, kv_events_topic="kv")
    tokens = prompt(1, 14)  # 3 whole blocks at prefill; the 4th fills during decode
    run(eng, [tokens])
    events = raw_events(eng.kv_events)
    assert events and all(list(e) == STORED_KEYS for e in events)
    assert {e["type"] for e in events} == {"BlockStored"}
    assert all(e["block_size"] == BS and e["medium"] == "GPU" and e["token_ids"] == [] for e in events)
    assert all(e["lora_id"] is None and e["lora_name"] is None for e in events)
    hashes = [h for e in events for h in e["block_hashes"]]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert hashes[:3] == chain_keys(b"", tokens[:12], BS, extra_key(None))  # kvserve's chained block keys
    assert len(hashes) == (14 + 6 - 1) // BS  # every whole block, generated tokens' too
    assert events[0]["parent_block_hash"] is None
    for before, after in zip(events, events[1:], strict=False):  # a continuation's parent: the block before it
        assert after["parent_block_hash"] == before["block_hashes"][-1]
    eng.shutdown()


def test_token_ids_are_published_only_when_asked(tiny_model_dir):
    eng = engine(tiny_model_dir, kv_events_token_ids=True)
    tokens = prompt(2, 13)
    run(eng, [tokens])
    first = raw_events(eng.kv_events)[0]
    assert first["token_ids"] == tokens[: len(first["block_hashes"]) * BS]
    eng.shutdown()


def test_eviction_from_a_small_pool_and_a_reset_are_announced(tiny_model_dir):
    eng = engine(tiny_model_dir, num_kv_blocks=8)  # 32 tokens: the second prompt needs the first's blocks
    run(eng, [prompt(3, 18)])
    run(eng, [prompt(4, 18)])
    events = raw_events(eng.kv_events)
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and all(list(e) == ["type", "block_hashes", "medium"] and e["medium"] == "GPU" for e in removed)
    gone = [h for e in removed for h in e["block_hashes"]]
    assert set(gone) <= set(stored[: len(stored) // 2 + 1]) and len(set(gone)) == len(gone)
    assert eng.reset_prefix_cache()
    assert raw_events(eng.kv_events)[-1] == {"type": "AllBlocksCleared"}
    eng.shutdown()


def test_blocks_moving_down_the_tiers_are_announced_with_their_medium(tiny_model_dir, tmp_path):
    block = 2 * 2 * 2 * 16 * 4 * BS  # layers, K and V, kv heads, head dim, float32, tokens
    eng = engine(
        tiny_model_dir, num_kv_blocks=8, kv_host_memory=2 * block, kv_disk_dir=str(tmp_path), kv_disk_size=3 * block
    )
    run(eng, [prompt(5, 18), prompt(6, 18), prompt(7, 18)])
    eng.store.flush()  # the disk's writes (and their events) are on the writer thread
    events = raw_events(eng.kv_events)

    def hashes(kind: str, medium: str) -> set[bytes]:
        return {h for e in events if (e["type"], e.get("medium")) == (kind, medium) for h in e["block_hashes"]}

    assert hashes("BlockStored", "CPU") and hashes("BlockRemoved", "CPU") and hashes("BlockStored", "STORAGE")
    assert hashes("BlockStored", "CPU") <= hashes("BlockRemoved", "GPU")  # write-back: evicted blocks go down
    assert hashes("BlockStored", "STORAGE") <= hashes("BlockRemoved", "CPU")
    assert hashes("BlockRemoved", "STORAGE") <= hashes("BlockStored", "STORAGE")  # the disk evicts too
    assert hashes("BlockRemoved", "STORAGE")
    in_tiers = [e for e in events if e["type"] == "BlockStored" and e["medium"] != "GPU"]
    assert all(e["parent_block_hash"] is None and e["token_ids"] == [] for e in in_tiers)
    held_on_host = len(eng.store.tiers[0])
    assert eng.reset_prefix_cache()
    after = raw_events(eng.kv_events)[len(events) :]
    cleared = after.index({"type": "AllBlocksCleared"})
    again = [e for e in after[cleared:] if e.get("medium") == "CPU"]  # the tiers kept theirs: announced again
    assert sum(len(e["block_hashes"]) for e in again) == held_on_host > 0
    eng.shutdown()


def test_events_never_carry_the_salt(tiny_model_dir):
    salt = "tenant-salt-0123456789"
    eng = engine(tiny_model_dir, kv_events_token_ids=True)
    run(eng, [prompt(8, 18)], salt=salt)
    raw = b"".join(b"".join(frames) for frames in replay(eng.kv_events))
    assert raw and salt.encode() not in raw and salt.encode().hex().encode() not in raw
    assert extra_key(salt) not in raw and extra_key(salt).hex().encode() not in raw
    events = raw_events(eng.kv_events)
    assert events[0]["block_hashes"][0] == chain_keys(b"", prompt(8, 18)[:BS], BS, extra_key(salt))[0]
    eng.shutdown()


def test_the_subscriber_repairs_a_gap_and_a_late_start_by_replay():
    pub = ZmqEventPublisher(LOCAL, LOCAL, "t")
    batches = [[BlockStored([bytes([i]) * 32], None, [], BS)] for i in range(6)]
    for b in batches[:3]:  # before anyone listens: a late subscriber must replay them
        pub.publish(b)
    replay(pub)
    got: list[tuple[int, list]] = []

    class Lossy(KVEventSubscriber):
        def _receive(self, frames: list[bytes]) -> None:
            if frames[1] == (4).to_bytes(8, "big"):  # as if PUB had dropped it
                return
            super()._receive(frames)

    sub = Lossy(pub.endpoint, pub.replay_endpoint, "t", lambda seq, ts, events: got.append((seq, events)))
    time.sleep(0.3)  # the SUB socket's connection is made in the background
    for b in batches[3:]:
        pub.publish(b)
    deadline = time.monotonic() + 5
    while len(got) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [seq for seq, _ in got] == list(range(6))
    assert [events for _, events in got] == batches
    assert sub.last_seq == 5 and sub.missed_batches == 0 and time.monotonic() - sub.last_event_time < 5
    sub.close()
    pub.close()


def test_a_full_queue_drops_a_batch_without_blocking_and_its_seq_is_a_gap(monkeypatch):
    pub = ZmqEventPublisher(LOCAL, LOCAL, max_queue_size=1)
    stuck, send = threading.Event(), pub._send
    monkeypatch.setattr(pub, "_send", lambda *batch: (stuck.wait(5), send(*batch)))
    assert pub.publish([AllBlocksCleared()])  # seq 0: taken by the thread, which then waits
    wait_empty(pub)
    assert pub.publish([AllBlocksCleared()])  # seq 1: fills the queue
    start = time.monotonic()
    assert not pub.publish([AllBlocksCleared()]) and pub.dropped_batches == 1  # seq 2: dropped at once
    assert time.monotonic() - start < 0.1
    stuck.set()
    wait_empty(pub)
    assert pub.publish([AllBlocksCleared()])  # seq 3
    assert [int.from_bytes(seq, "big") for _, seq, _ in replay(pub)] == [0, 1, 3]
    pub.close()


def test_endpoints():
    assert default_replay_endpoint("tcp://*:5557") == "tcp://*:5558"
    assert default_replay_endpoint("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"
    assert default_replay_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv-replay"
    assert default_replay_endpoint("tcp://collector:5557") is None  # connected out: nothing to bind beside it
    assert connectable("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connectable("tcp://0.0.0.0:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert connectable("tcp://10.1.1.1:5557", "10.0.0.2") == "tcp://10.1.1.1:5557"
    for bad in ("tcp://host", "http://x:1"):
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            EngineConfig(kv_events_endpoint=bad)


def test_no_endpoint_no_events(tiny_model_dir):
    eng = engine(tiny_model_dir, kv_host_memory="1MiB", kv_events_endpoint=None)
    assert eng.kv_events is None and eng.kv.events is None and eng.store.events is None
    eng.shutdown()  # with a store and without a publisher
    eng = engine(tiny_model_dir)
    assert eng.store is None
    eng.shutdown()  # with a publisher and without a store


# the server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = [*TINY_ARGS, "--served-model-name", "tiny", "--kv-events-endpoint", "tcp://*:*", "--block-size", "8"]
    with ServerThread(tiny_model_dir, *args) as s:
        yield s


def test_server_info_tells_a_router_what_it_needs(server, tiny_model_dir):
    r = httpx.get(f"{server.url}/server_info")  # no key needed (and none set here)
    assert r.status_code == 200
    info = r.json()
    events = info.pop("kv_events")
    assert info.pop("kvserve_version")
    assert info == {
        "model": str(tiny_model_dir),
        "served_model_name": "tiny",
        "tokenizer_dir": str(tiny_model_dir.resolve()),
        "block_size": 8,
        "num_kv_blocks": info["num_kv_blocks"],
        "kv_capacity_tokens": info["num_kv_blocks"] * 8,
        "kv_cache_dtype": "float32",  # --dtype float32: a reference run
        "kv_bytes_per_token": 2 * 2 * 2 * 16 * 4,  # K and V, 2 layers, 2 KV heads of 16, fp32
        "max_model_len": 512,
        "kv_tiers": [],
        "api_keys_required": False,
        "role": "both",  # prefill/decode disaggregation: a both replica prefills for others too
        "kv_transfer_endpoint": f"{server.url}/kv_transfer/pull",
    }
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["replay_endpoint"].startswith(
        "tcp://127.0.0.1:"
    )
    assert events["topic"] == "" and events["token_ids"] is False
    got: list[int] = []
    sub = KVEventSubscriber(events["endpoint"], events["replay_endpoint"], "", lambda s, ts, ev: got.append(s))
    body = {"prompt": prompt(9, 20), "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[0] == 0  # live, or replayed where the SUB socket connected too late for it
    sub.close()


def test_unknown_fields_are_ignored_and_logged_once_by_name(server, caplog):
    logger.addHandler(caplog.handler)  # the kvserve logger does not propagate to the root
    try:
        for _ in range(2):
            body = {"prompt": "hi", "max_tokens": 1, "router_hint": "secret-value", "stream_options_x": {"a": 1}}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi", "weight": 2}], "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
    finally:
        logger.removeHandler(caplog.handler)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warned) == sorted(
        f"ignoring the unknown request field `{name}` (said once per field)"
        for name in ("router_hint", "stream_options_x", "messages.weight")
    )
    assert not any("secret-value" in m for m in warned)


def test_strict_fields_refuses_unknown_ones_by_name(tiny_model_dir):
    with ServerThread(tiny_model_dir, *TINY_ARGS, "--strict-fields", "--api-key", "k") as s:
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "logit_bias": {"1": 5}}, headers=auth)
        assert r.status_code == 400 and error_of(r)["param"] == "logit_bias" and "logit_bias" in error_of(r)["message"]
        chat = {"messages": [{"role": "user", "content": "hi", "weight": 2}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, headers=auth)
        assert r.status_code == 400 and error_of(r)["param"] == "messages.0.weight"
        chat |= {"router_hint": 1, "no_stop_trim": True}  # every one named, as a router adds several
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, headers=auth)
        assert r.status_code == 400 and "unknown fields" in error_of(r)["message"]
        message = error_of(r)["message"]
        assert all(f"`{name}`" in message for name in ("router_hint", "no_stop_trim", "messages.0.weight"))
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth, timeout=30)
        assert ok.status_code == 200
        info = httpx.get(f"{s.url}/server_info").json()  # no key needed
        assert info["api_keys_required"] is True and info["kv_events"] is None
