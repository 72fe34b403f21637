"""`kvserve` command line: serve, router, generate, chat, bench, cache."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.engine_args import add_engine_args, engine_config


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)  # --seed is the engine's


def sampling_params(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from kvserve.entrypoints.llm import LLM

    llm = LLM(**vars(engine_config(args)))
    sp = sampling_params(args)
    if args.chat_template:
        outs = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, sp, use_tqdm=False)
    print(outs[0].outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.tokenizer import apply_chat_template

    engine = LLMEngine(engine_config(args))
    sp = sampling_params(args)
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            return
        messages.append({"role": "user", "content": user})
        prompt = apply_chat_template(engine.tokenizer, messages)
        reply = stream_reply(engine, prompt, sp)
        messages.append({"role": "assistant", "content": reply})


def stream_reply(engine, prompt: str, sp) -> str:
    """Print the reply as tokens arrive; returns the whole text."""
    request_id = engine.add_request(prompt, sp)
    shown = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                text = out.outputs[0].text
                print(text[len(shown) :], end="", flush=True)
                shown = text
    print()
    return shown


def cmd_serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.pd and args.replicas < 2:
        raise ValueError(f"--pd needs --replicas 2 or more (a prefill and a decode replica), got {args.replicas}")
    if args.replicas > 1:
        from kvserve.entrypoints.cluster import run_cluster  # this process runs the router: it never loads torch

        run_cluster(args)
        return
    from kvserve.server.api_server import run_server

    run_server(args)


def cmd_router(args: argparse.Namespace) -> None:
    from kvserve.router.app import run_router  # no torch: the router's process never loads it

    run_router(args)


def cmd_cache_clear(args: argparse.Namespace) -> None:
    from kvserve.models.loader import clear_cache

    print(f"removed {clear_cache()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.server.args import add_server_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, help="the model to serve (same as --model)")
    add_engine_args(serve)
    add_server_args(serve)
    from kvserve.entrypoints.cluster import add_cluster_args

    add_cluster_args(serve)
    serve.set_defaults(func=cmd_serve)

    from kvserve.router.args import add_router_args

    router = sub.add_parser("router", help="OpenAI-compatible front for several replicas, routing by their KV caches")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    gen = sub.add_parser("generate", help="one completion for a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user message")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    cache = sub.add_parser("cache", help="the converted-weights cache")
    cache.add_argument("action", choices=["clear"])
    cache.set_defaults(func=cmd_cache_clear)

    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
