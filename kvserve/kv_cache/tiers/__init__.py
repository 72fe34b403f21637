"""KV tiers below the device pool: host RAM, local disk, Redis or a Redis Cluster. No torch: payloads are bytes.

Each tier maps 32-byte tier keys (`namespace.tier_key`: the namespace digest and a
block's chained key, hashed together) to one block's K/V. `store.TieredKVStore` chains
them and moves blocks down on eviction; the engine converts blocks to and from bytes.
"""
