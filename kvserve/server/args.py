"""The flags of `kvserve serve` beyond the engine's."""

from __future__ import annotations

import argparse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the model)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-keys", metavar="FILE", default=None, help="lines 'key tenant'; # comments allowed")
    keys.add_argument("--api-key", default=None, help="one key, for the tenant 'default'")
    parser.add_argument(
        "--cache-secret", default=None, help="keys the per-tenant cache salts (default: random at start)"
    )
    parser.add_argument("--max-queued-requests", type=int, default=256, help="more waiting requests get 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain requests after SIGTERM")
    parser.add_argument("--max-request-body-size", type=int, default=4 * 2**20, help="bytes; larger bodies get 413")
    parser.add_argument("--stats-log-interval", type=float, default=5.0, help="seconds between stats log lines")
