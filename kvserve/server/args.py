"""The flags of `kvserve serve` beyond the engine's."""

from __future__ import annotations

import argparse

# Prefill tokens per step when serving (offline LLM keeps EngineConfig's 2048, as vLLM
# also picks a smaller budget for its server than for offline use). On a 2-core CPU a
# 2048-token step takes ~0.35 s, stalling every running stream and making a burst of
# requests wait for one another; 512-token chunks, measured with bench_client.py at c=8:
# TTFT p50 0.47 -> 0.29 s, output tok/s 267 -> 240.
SERVER_MAX_NUM_BATCHED_TOKENS = 512


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, and its engine defaults where they differ from offline use."""
    parser.set_defaults(max_num_batched_tokens=SERVER_MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the model)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-keys", metavar="FILE", default=None, help="lines 'key tenant'; # comments allowed")
    keys.add_argument("--api-key", default=None, help="one key, for the tenant 'default'")
    parser.add_argument(
        "--cache-secret",
        default=None,
        help="keys the per-tenant cache salts; required with --kv-remote (default: kept beside the "
        "disk tier, or random at start without one)",
    )
    parser.add_argument("--max-queued-requests", type=int, default=256, help="more waiting requests get 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain requests after SIGTERM")
    parser.add_argument("--max-request-body-size", type=int, default=4 * 2**20, help="bytes; larger bodies get 413")
    parser.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse requests with fields kvserve does not know (400); default: ignore them, logged once per name",
    )
    parser.add_argument("--stats-log-interval", type=float, default=5.0, help="seconds between stats log lines")
