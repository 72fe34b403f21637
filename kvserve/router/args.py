"""The flags of `kvserve router` (argparse only: `kvserve --help` must stay light)."""

from __future__ import annotations

import argparse

POLICIES = ("cache_aware", "least_loaded", "round_robin")
HEALTH_INTERVAL = 0.5  # seconds between checks: a dead replica is noticed within ~1 s, well inside 2 s


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://host:8001 (repeat for each); all serve the same model",
    )
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-keys", metavar="FILE", default=None, help="the replicas' file: lines 'key tenant'")
    keys.add_argument("--api-key", default=None, help="one key, for the tenant 'default' (as the replicas')")
    parser.add_argument(
        "--cache-secret",
        default=None,
        help="the replicas' --cache-secret: without it the router cannot compute their block keys and "
        "routes by what it sent each replica instead of their KV events",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="the model's tokenizer files, where the replicas' tokenizer_dir is not on this machine "
        "(without either, each prompt is tokenized by a replica's /tokenize)",
    )
    parser.add_argument(
        "--health-check-interval",
        type=float,
        default=HEALTH_INTERVAL,
        help="seconds between health checks of each replica (at most 1)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait on a replica's answer")
    parser.add_argument("--max-request-body-size", type=int, default=4 * 2**20, help="bytes; larger bodies get 413")
