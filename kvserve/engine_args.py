"""Engine arguments on the command line: one flag per `EngineConfig` field, and back.

The CLI, the server and the benchmarks all build their engine from these flags, so a
new `EngineConfig` field is a new flag everywhere at once, named as in vLLM
(`max_num_seqs` -> `--max-num-seqs`; booleans get `--no-...` too).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvserve.config import EngineConfig

_ENGINE_HELP = {
    "model": "directory, .gguf file or short name (smollm2-135m, gemma3-270m)",
    "dtype": "auto | float32 | bfloat16",
    "kv_cache_dtype": "auto | float32 | bfloat16 | int8: how K/V are stored (auto: bfloat16 where the attention "
    "kernels read it, float32 under --dtype float32; int8: 8 bits per value plus a scale and a minimum per "
    "token and KV head: head_dim + 8 bytes per token and head, 1.8x bf16's tokens per GiB at head_dim 64)",
    "device": "auto | cpu | cuda",
    "kv_cache_memory": "KV pool budget, e.g. 2GiB",
    "num_kv_blocks": "exact number of KV blocks (overrides --kv-cache-memory)",
    "prefix_cache": "radix (RadixAttention tree) | hash (chained block hashes)",
    "kv_remote": "the KV tier replicas share: redis://[[user]:password@]host:port/db (rediss:// for TLS), or a "
    "Redis / Valkey Cluster, redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// for TLS)",
    "disable_hybrid_kv_cache_manager": "sliding-window models: one block table for every layer, each keeping "
    "its whole history (no window blocks released); the baseline of `kvserve bench window`",
    "kv_events_endpoint": "publish KV events (vLLM's format) on this ZMQ address, e.g. tcp://*:5557",
    "kv_events_replay_endpoint": "ZMQ address of the replay socket (default: the same host, port + 1)",
    "kv_events_topic": "topic of every KV event message (default: none, as in vLLM)",
    "kv_events_token_ids": "put blocks' token ids in the events (off: hashes only; vLLM sends every tenant's tokens)",
    "kv_events_encoding": "map (vLLM now) | array (vLLM before #42892, for older consumers)",
    "role": "both | prefill (holds a finished prompt's blocks for a decode replica: kv_transfer_params "
    "do_remote_decode) | decode (pulls them: do_remote_prefill)",
    "kv_lease_seconds": "how long a prefill replica holds a handed-off prompt's blocks for the decode side",
    "kv_load_failure_policy": "recompute (a failed pull of remote blocks is computed here) | fail (an error, as vLLM)",
    "prefill_first": "steps that admit new prompts run only their prefills; decodes wait a step "
    "(SGLang's default: lower time to first token, one longer gap between tokens)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, e.g. --max-num-seqs."""
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":  # --enable-prefix-caching / --no-enable-prefix-caching, as in vLLM
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=_ENGINE_HELP.get(f.name)
            )
            continue
        kind = int if f.type in ("int", "int | None") else float if f.type == "float" else str
        parser.add_argument(flag, type=kind, default=f.default, help=_ENGINE_HELP.get(f.name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
