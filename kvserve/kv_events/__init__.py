"""KV events out of a replica and into a router, in vLLM's wire format (ZMQ + msgpack).

`wire` encodes and decodes batches, `publisher.ZmqEventPublisher` sends them (with a replay
socket), `subscriber.KVEventSubscriber` reads them, repairing gaps by replay. No torch: a
router imports this package.
"""
