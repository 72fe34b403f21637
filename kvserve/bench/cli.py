"""`kvserve bench ...`: offline throughput, and prefix caching off / radix / hash."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.entrypoints.cli import add_engine_args, engine_config

if TYPE_CHECKING:
    from kvserve.bench.throughput import ThroughputResult

WORKLOADS = ("sharegpt", "random")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, prefix caching")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(bench_sub)
    add_prefix_parser(bench_sub)


def add_throughput_parser(subparsers: argparse._SubParsersAction) -> None:
    tp = subparsers.add_parser(
        "throughput",
        help="run an offline workload to completion; report tokens/s and KV use",
        conflict_handler="resolve",  # our --seed replaces the engine's, whose dest it shares
    )
    tp.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    tp.add_argument("--num-prompts", type=int, default=200)
    tp.add_argument("--input-len", type=int, default=512, help="random workload: prompt tokens")
    tp.add_argument("--output-len", type=int, default=128, help="random workload: output tokens")
    tp.add_argument("--baseline", choices=("none", "hf"), default="none", help="hf: transformers generate")
    tp.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the hf baseline")
    tp.add_argument("--output-json", type=Path, default=None, help="also write the result here")
    add_engine_args(tp)
    tp.add_argument("--seed", type=int, default=0, help="seeds the workload sample and the engine's sampler")
    tp.set_defaults(func=cmd_throughput)


def add_prefix_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prefix",
        help="the same workload with prefix caching off, radix and hash; ratios vs off",
        conflict_handler="resolve",
    )
    p.add_argument("--workload", choices=("multiturn", "shared-prefix"), default="multiturn")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (shared-prefix) or conversations")
    p.add_argument("--concurrency", type=int, default=8, help="multiturn: conversations in flight at once")
    p.add_argument("--max-turns", type=int, default=4, help="multiturn: user turns per conversation, at most")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens every request shares")
    p.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens of each request's own")
    p.add_argument("--output-len", type=int, default=32, help="shared-prefix: output tokens per request")
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload sample and the engine's sampler")
    p.set_defaults(func=cmd_prefix)


def cmd_prefix(args: argparse.Namespace) -> None:
    from kvserve.bench import conversations as conv
    from kvserve.bench import prefix_cache as bench
    from kvserve.model.loader import load_config, resolve_model
    from kvserve.tokenizer import load_tokenizer

    config = engine_config(args)
    model_dir = resolve_model(config.model)
    if args.workload == "multiturn":
        chats = conv.sample_multiturn(load_tokenizer(model_dir), args.num_prompts, args.seed, args.max_turns)
        results = bench.run_all_modes(config, lambda e: bench.run_multiturn(e, chats, args.concurrency))
    else:
        vocab = load_config(model_dir).vocab_size
        reqs = conv.shared_prefix_requests(
            vocab, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, args.seed
        )
        results = bench.run_all_modes(config, lambda e: bench.run_shared_prefix(e, reqs))
    bench.print_table(results)
    print(json.dumps([asdict(r) for r in results]))
    if args.output_json:
        args.output_json.write_text(json.dumps([asdict(r) for r in results]) + "\n")


def cmd_throughput(args: argparse.Namespace) -> None:
    from kvserve.bench.datasets import load_workload
    from kvserve.bench.throughput import print_table, run_throughput
    from kvserve.model.loader import resolve_model

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    config = engine_config(args)
    model_dir = resolve_model(config.model)
    requests = load_workload(args.workload, model_dir, args.num_prompts, args.seed, args.input_len, args.output_len)
    result = run_throughput(config, requests, workload=args.workload, use_tqdm=True)
    if args.baseline == "hf":
        from kvserve.bench.hf_baseline import run_hf_baseline

        _write_json(args.output_json, result)  # a long baseline run that dies still leaves kvserve's numbers
        result.attach_baseline(run_hf_baseline(model_dir, requests, result.dtype, result.device, args.hf_batch_size))
    print_table(result)
    print(json.dumps(asdict(result)))
    _write_json(args.output_json, result)


def _write_json(path: Path | None, result: ThroughputResult) -> None:
    if path:
        path.write_text(json.dumps(asdict(result)) + "\n")
