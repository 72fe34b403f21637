"""`kvserve bench ...`: offline throughput, and prefix caching off / radix / hash."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench.datasets import OFFLINE_WORKLOADS, SERVE_WORKLOADS
from kvserve.engine_args import add_engine_args, engine_config

if TYPE_CHECKING:
    from kvserve.bench.throughput import ThroughputResult


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, prefix caching, online serving")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(bench_sub)
    add_prefix_parser(bench_sub)
    add_step_parser(bench_sub)
    add_serve_parser(bench_sub)


def add_throughput_parser(subparsers: argparse._SubParsersAction) -> None:
    tp = subparsers.add_parser(
        "throughput",
        help="run an offline workload to completion; report tokens/s and KV use",
        conflict_handler="resolve",  # our --seed replaces the engine's, whose dest it shares
    )
    tp.add_argument("--workload", choices=OFFLINE_WORKLOADS, default="sharegpt")
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
    p.add_argument("--rounds", type=int, default=1, help="run the three modes in turn this many times; report medians")
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload sample and the engine's sampler")
    p.set_defaults(func=cmd_prefix)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser(
        "serve",
        help="online: stream a workload to any OpenAI-compatible server; TTFT, TPOT, ITL, throughput",
        description="Poisson arrivals (or all at once), at most --max-concurrency in flight; "
        "latencies from the streamed chunks, token counts and cached tokens from the usage chunk.",
    )
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--model", default=None, help="default: the first model GET /v1/models lists")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    s.add_argument("--tokenizer", default=None, help="makes text of the workload's tokens; default: the model's")
    s.add_argument("--workload", choices=SERVE_WORKLOADS, default="sharegpt")
    s.add_argument("--num-prompts", type=int, default=200, help="requests, or conversations for multiturn")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="per second; inf: all at once")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests (conversations) in flight")
    s.add_argument("--num-warmups", type=int, default=0, help="short requests sent before the clock starts")
    s.add_argument("--input-len", type=int, default=512, help="random workload: prompt tokens")
    s.add_argument("--output-len", type=int, default=128, help="random, shared-prefix: output tokens")
    s.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens every request shares")
    s.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: tokens of each request's own")
    s.add_argument("--max-turns", type=int, default=4, help="multiturn: user turns per conversation, at most")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exact output lengths (multiturn sends min_tokens instead, so no reply holds the end-of-turn token)",
    )
    s.add_argument("--seed", type=int, default=0, help="seeds the workload sample and the arrival times")
    s.add_argument("--output-json", "--result-json", type=Path, default=None, help="result and every request")
    s.add_argument("--plot", type=Path, default=None, help="a PNG of latency distributions and throughput")
    s.add_argument("--disable-tqdm", action="store_true")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    import asyncio

    from kvserve.bench import serve

    cards = serve.list_models(args.base_url, args.api_key)
    config = serve.ServeConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model or cards[0]["id"],
        api_key=args.api_key,
        workload=args.workload,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        num_warmups=args.num_warmups,
    )
    served = [n for c in cards if c["id"] == config.model for n in (c.get("root"), c["id"]) if n]
    tokenizer = serve.load_bench_tokenizer(args.tokenizer, served or [config.model])
    lengths = ("input_len", "output_len", "prefix_len", "suffix_len", "max_turns")
    spec = serve.WorkloadSpec(args.workload, args.num_prompts, args.seed, **{k: getattr(args, k) for k in lengths})
    sessions = serve.load_sessions(spec, tokenizer)
    result = asyncio.run(serve.run_benchmark(config, sessions, tokenizer, progress=not args.disable_tqdm))
    print(serve.format_table(result))
    print(json.dumps(result.summary()))
    if args.output_json:
        args.output_json.write_text(json.dumps(result.to_json()) + "\n")
    if args.plot:
        from kvserve.bench.serve_plot import plot_result

        plot_result(result, args.plot)


def add_step_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "step",
        help="decode step time at fixed batch sizes vs the measured roofline, with a profile",
        conflict_handler="resolve",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context-len", type=int, default=256, help="prompt tokens of every request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--profile", action="store_true", help="also break a step down with torch.profiler")
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_step)


def cmd_step(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from kvserve.bench import roofline, step
    from kvserve.engine.llm_engine import LLMEngine

    if min(args.batch_sizes) < 1 or args.steps < 1 or args.context_len < 1:
        raise ValueError("--batch-sizes, --steps and --context-len must be >= 1")
    config = engine_config(args)
    engine = LLMEngine(replace(config, max_num_seqs=max(config.max_num_seqs, *args.batch_sizes)))
    limits = roofline.measure(engine.dtype, engine.device)
    results = [
        step.run_step_bench(engine, limits, b, args.context_len, args.steps, args.profile, args.seed)
        for b in args.batch_sizes
    ]
    step.print_table(results, limits)
    record = {"roofline": asdict(limits), "steps": [asdict(r) for r in results]}
    print(json.dumps(record))
    if args.output_json:
        args.output_json.write_text(json.dumps(record) + "\n")


def cmd_prefix(args: argparse.Namespace) -> None:
    from kvserve.bench import conversations as conv
    from kvserve.bench import prefix_cache as bench
    from kvserve.models.loader import load_config, resolve_model
    from kvserve.tokenizer import load_tokenizer

    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    config = engine_config(args)
    model_dir = resolve_model(config.model)
    if args.workload == "multiturn":
        chats = conv.sample_multiturn(load_tokenizer(model_dir), args.num_prompts, args.seed, args.max_turns)
        results = bench.run_rounds(config, lambda e: bench.run_multiturn(e, chats, args.concurrency), args.rounds)
    else:
        vocab = load_config(model_dir).vocab_size
        reqs = conv.shared_prefix_requests(
            vocab, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len, args.seed
        )
        results = bench.run_rounds(config, lambda e: bench.run_shared_prefix(e, reqs), args.rounds)
    bench.print_table(results)
    print(json.dumps([asdict(r) for r in results]))
    if args.output_json:
        args.output_json.write_text(json.dumps([asdict(r) for r in results]) + "\n")


def cmd_throughput(args: argparse.Namespace) -> None:
    from kvserve.bench.datasets import load_workload
    from kvserve.bench.throughput import print_table, run_throughput
    from kvserve.models.loader import resolve_model

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
