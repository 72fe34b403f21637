"""The flags of `kvserve router` (argparse only: `kvserve --help` must stay light)."""

from __future__ import annotations

import argparse

POLICIES = ("cache_aware", "least_loaded", "round_robin")
# cache_aware's weight of a prefill token against a token of KV held by a running request.
# Dynamo's default is 1; with CPU replicas, where prefill is the expensive part, weight 1 moved
# chats off their cache for a few hundred tokens of load difference. 4 kept 3-8 points more of
# the prompts cached than 1 at 8 chats in flight; 16 kept 2-4 more than 4 at 24 in flight (96
# chats: 76.1% against 72.1-74.2%, sglang-router's level) and 1-2 more at 8, with no higher TTFT
# (docs/bench-routers.md). Queued prefill is weighed as much, so a replica piling up prefills
# for its cache still loses the next request.
KV_OVERLAP_SCORE_WEIGHT = 16.0
HEALTH_INTERVAL = 0.5  # seconds between checks: a dead replica is noticed within ~1 s, well inside 2 s
# P/D: a decode replica prefills a request itself when it would compute at most this many prompt
# tokens (a warm turn: the transfer's round trips cost more than the prefill); more goes to a
# prefill replica first (Dynamo's and llm-d's conditional disaggregation).
MAX_LOCAL_PREFILL_TOKENS = 512
ROLES = ("prefill", "decode", "both")


def add_local_prefill_arg(parser: argparse.ArgumentParser) -> None:
    """The router's, also on `kvserve serve --replicas N --pd`, which hands it to its router."""
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=MAX_LOCAL_PREFILL_TOKENS,
        help="P/D: a decode replica that would compute at most this many prompt tokens (the rest cached "
        "there) prefills the request itself; more goes to a prefill replica first. Each such token "
        "delays the next token of every stream that replica decodes: on one of few cores, a lower "
        "value keeps their inter-token latency",
    )


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL, e.g. http://host:8001 (repeat for each); all serve the same model; its "
        "role is the one its /server_info reports ('both' where it reports none)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill replica (`kvserve serve --role prefill`): computes long uncached prompts and hands "
        "their KV to a decode replica (repeat for each)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode replica (`kvserve serve --role decode`): serves requests, its prompt's KV computed "
        "by a prefill replica when long and uncached there (repeat for each)",
    )
    add_local_prefill_arg(parser)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument(
        "--kv-overlap-score-weight",
        type=float,
        default=KV_OVERLAP_SCORE_WEIGHT,
        help="cache_aware: what a token of prefill (uncached here, or queued) costs against a token of "
        "KV held by a running request (Dynamo's overlap_score_weight, whose default is 1); higher keeps "
        "chats on their cache, lower balances load",
    )
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
