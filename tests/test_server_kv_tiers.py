"""KV tiers behind the server: two servers share a prefix through one Redis (same tenant only),
a restarted server finds its blocks on disk under the same tenant salts, and /metrics shows
each tier."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server_common import TINY_ARGS, Hold, ServerThread, metrics, write_keys

from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser
from kvserve.server.api_server import create_server
from kvserve.server.auth import server_cache_secret

PROMPT = "a long system prompt every replica sees, word for word, again and again; " * 6
GREEDY = dict(temperature=0, max_tokens=4)
BLOCK = 16  # the server's default block size


def complete(server: ServerThread, key: str, prompt: str = PROMPT):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    return client.completions.create(model=None, prompt=prompt, **GREEDY)


def cached(server: ServerThread, key: str, prompt: str = PROMPT) -> int:
    return complete(server, key, prompt).usage.prompt_tokens_details.cached_tokens


def tier_metric(server: ServerThread, name: str, tier: str) -> float:
    return metrics(server.url)[(f"kvserve:{name}", (("tier", tier),))]


def test_two_servers_share_a_prefix_through_redis_for_the_same_tenant_only(tiny_model_dir, tmp_path, redis_server):
    keys = write_keys(tmp_path / "keys.txt")
    args = ["--api-keys", str(keys), "--kv-remote", redis_server.url(), "--cache-secret", "shared", *TINY_ARGS]
    with ServerThread(tiny_model_dir, *args) as first, ServerThread(tiny_model_dir, *args) as second:
        computed = complete(first, "key-a")
        assert computed.usage.prompt_tokens_details.cached_tokens == 0
        first.engine.engine.store.flush()  # its blocks were queued for Redis as they filled

        assert cached(second, "key-b") == 0  # another tenant, same prompt
        shared = complete(second, "key-a")
        assert shared.usage.prompt_tokens_details.cached_tokens > 0
        assert shared.choices[0].text == computed.choices[0].text

        assert tier_metric(first, "kv_tier_written_bytes_total", "redis") > 0
        assert tier_metric(second, "kv_tier_hits_total", "redis") == shared.usage.prompt_tokens_details.cached_tokens
        assert tier_metric(second, "kv_tier_breaker_state", "redis") == 0
        m = metrics(second.url)
        assert m[("kvserve:external_prefix_cache_hits_total", ())] > 0
        assert m[("kvserve:kv_tier_load_seconds_count", (("tier", "redis"),))] > 0


def shard_metric(m: dict, name: str, shard: str) -> float:
    return m[(f"kvserve:{name}", (("shard", shard), ("tier", "redis-cluster")))]


def test_a_master_killed_under_16_requests_fails_none_and_only_its_shard_steps_aside(
    tiny_model_dir, tmp_path, redis_cluster
):
    keys = write_keys(tmp_path / "keys.txt")
    args = ["--api-keys", str(keys), "--kv-remote", redis_cluster.url(), "--cache-secret", "shared", *TINY_ARGS]
    prompts = [f"conversation {i}: " + PROMPT for i in range(16)]  # each its own first block
    with ServerThread(tiny_model_dir, *args) as writer:
        with ThreadPoolExecutor(16) as pool:
            expected = list(pool.map(lambda p: complete(writer, "key-a", p).choices[0].text, prompts))
        writer.engine.engine.store.flush()
    dead = f"127.0.0.1:{redis_cluster.ports[1]}"
    live = [f"127.0.0.1:{p}" for i, p in enumerate(redis_cluster.ports) if i != 1]
    # the engine is held after its first step, at most 4 running: the other requests are admitted,
    # and look their blocks up, after the kill
    with ServerThread(tiny_model_dir, *args, "--max-num-seqs", "4") as reader:
        core = reader.engine.engine
        hold = Hold(lambda: len(core.scheduler.running) > 0)
        reader.engine.on_step.append(hold)
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(complete, reader, "key-a", p) for p in prompts]
            assert hold.held.wait(60), "no request ran"
            hits_at_kill = sum(s.hits for s in core.store.snapshot()[0].shards)
            redis_cluster.kill(1)
            hold.release.set()
            texts = [f.result().choices[0].text for f in futures]  # raises on a failed request
        assert texts == expected
        m = metrics(reader.url)
        assert sum(shard_metric(m, "kv_tier_shard_hits_total", s) for s in live) > hits_at_kill * BLOCK
        assert shard_metric(m, "kv_tier_shard_breaker_state", dead) == 1
        assert [shard_metric(m, "kv_tier_shard_breaker_state", s) for s in live] == [0, 0]
        labels = (("kind", "connection"), ("shard", dead), ("tier", "redis-cluster"))
        assert m[("kvserve:kv_tier_shard_errors_total", labels)] > 0
        assert tier_metric(reader, "kv_tier_breaker_state", "redis-cluster") == 0  # the tier as a whole serves
        assert tier_metric(reader, "kv_tier_hits_total", "redis-cluster") > 0
        state = httpx.get(f"{reader.url}/debug/kv_state", headers={"Authorization": "Bearer key-a"}).json()
        (tier,) = state["tiers"]
        assert {s["name"]: s["breaker_state"] for s in tier["shards"]} == {dead: 1, live[0]: 0, live[1]: 0}


def test_a_restarted_server_finds_its_tenants_blocks_on_disk(tiny_model_dir, tmp_path):
    keys = write_keys(tmp_path / "keys.txt")
    disk = ["--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-size", "64MiB"]
    args = ["--api-keys", str(keys), *disk, *TINY_ARGS]
    with ServerThread(tiny_model_dir, *args) as before:
        text = complete(before, "key-a").choices[0].text
    # stopping wrote the cached blocks back to disk; the secret beside them gives the same salts
    with ServerThread(tiny_model_dir, *args) as after:
        again = complete(after, "key-a")
        assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.choices[0].text == text
        assert cached(after, "key-b") == 0
        assert tier_metric(after, "kv_tier_hits_total", "disk") > 0
        assert tier_metric(after, "kv_tier_capacity_bytes", "disk") == 64 * 2**20


def test_the_cache_secret_is_kept_beside_the_disk_tier_owner_only(tmp_path):
    config = EngineConfig(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size="1GiB")
    secret = server_cache_secret(None, config)
    path = tmp_path / "kv" / "cache_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server_cache_secret(None, config) == secret  # a restart reads it back
    assert server_cache_secret("given", config) == b"given"
    assert server_cache_secret(None, EngineConfig(kv_disk_size=0)) != server_cache_secret(
        None, EngineConfig(kv_disk_size=0)
    )  # no persistent tier: random at every start


def test_redis_without_a_cache_secret_is_refused_at_start(tiny_model_dir):
    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--kv-remote", "redis://127.0.0.1:1/0"])
    with pytest.raises(ValueError, match="--cache-secret"):
        create_server(args)
