"""`python tools/routers`: kvserve's router against round-robin, least-loaded, sglang-router and vllm-router.

Two real replicas (`kvserve serve`, one core each, KV events on, one cache secret, device
pools sized so the chats' working set is --working-set-ratio x one pool) are started fresh for
every policy, so each policy starts with empty caches. In front of them runs one router at a
time: kvserve's (`kvserve router --policy ...`) or a peer's (`cache_aware`, from the anchors'
router-venv). `kvserve bench serve --workload multiturn` is the client for every one of them; the
harness only collects its JSON. Besides the policy runs: the router's added latency (small
max_tokens=1 requests, direct vs routed, interleaved), an in-process routing-decision
micro-measure on an 8k-token prompt (tokenization timed apart), kvserve cache_aware with a host
tier, kvserve cache_aware with one replica SIGKILLed mid-run, and each policy again on the
shared-system-prompt workload (`system_prompt.py`: one 1k-token system prompt, several tenants).
Not part of the kvserve package: see README.md here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from routers_report import write_report
from system_prompt import key as system_key
from system_prompt import run_workload as run_system_workload
from system_prompt import sample_chats, system_prompt
from system_prompt import summarize as summarize_system
from system_prompt import write_keys as write_system_keys

from kvserve.entrypoints.cluster import _die_with_parent, core_groups, free_port
from kvserve.kv_cache.block_keys import HASHED_IN

ANCHORS_ENV = "ANCHORS"
# policy name -> (label, which router runs it)
POLICIES: dict[str, tuple[str, str]] = {
    "round_robin": ("kvserve round_robin", "kvserve"),
    "least_loaded": ("kvserve least_loaded", "kvserve"),
    "cache_aware": ("kvserve cache_aware", "kvserve"),
    "sglang": ("sglang-router cache_aware", "sglang"),
    "vllm": ("vllm-router cache_aware", "vllm"),
}
SECRET = "kvserve-bench-routers"  # any string: what matters is that the replicas and kvserve's router share it
START_TIMEOUT_S = 300.0
ROUTER_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
PROBE_PROMPT = "Hi"  # under one block: no prefix-cache hit can shorten a probe, routed or direct
DECISION_TOKENS = 8192


@dataclass
class BenchConfig:
    out: Path  # the report: <out>.md and <out>.json
    anchors: Path | None
    work: Path = Path("/tmp/kvserve-bench-routers")  # scratch: each run's logs and benchmark JSON
    policies: tuple[str, ...] = tuple(POLICIES)
    conversations: int = 24
    turns: int = 4
    concurrency: int = 8
    seed: int = 0
    working_set_ratio: float = 2.5  # the chats' working set / one replica's device pool
    probes: int = 30  # max_tokens=1 requests each way for the added latency
    decision_reps: int = 300
    tiers_on: bool = True
    kill: bool = True
    weights: tuple[float, ...] = ()  # kvserve cache_aware again at each --kv-overlap-score-weight
    weight_rounds: int = 1  # the weights' runs, alternated, this many times
    kill_after_s: float = 30.0
    system_prompt: bool = True  # each policy again on the shared-system-prompt workload
    tenants: int = 4  # its API keys, chats dealt out in turn
    system_tokens: int = 1024  # its system prompt, at least
    run_timeout_s: float = 900.0
    render_only: bool = False
    decision_only: bool = False


@dataclass(frozen=True)
class Sizing:
    """The workload and the replicas' device pools, computed from it."""

    conversations: int
    turns: int  # user turns the sampled chats have, all together
    working_set_tokens: int
    bytes_per_token: int
    block_size: int
    pool_bytes: int
    pool_tokens: int
    working_set_ratio: float
    host_tier_bytes: int  # tiers-on: a host tier that holds the whole working set


def pool_for(working_set_tokens: int, ratio: float, bytes_per_token: int, block_size: int) -> tuple[int, int]:
    """(bytes, tokens) of a device pool of whole blocks such that the working set is `ratio` x it."""
    blocks = max(1, -(-working_set_tokens // int(ratio * block_size)))
    return blocks * block_size * bytes_per_token, blocks * block_size


@dataclass
class Proc:
    """A child process with its output in a log file; SIGKILLed by the kernel if this harness dies."""

    name: str
    cmd: list[str]
    log: Path
    cpus: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        cpus = self.cpus or sorted(os.sched_getaffinity(0))
        parent = os.getpid()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                process_group=0,
                preexec_fn=lambda: _die_with_parent(parent, cpus),
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        self.popen.terminate()
        try:
            self.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def cpu_seconds(self) -> float | None:
        """User + system CPU time so far (Linux /proc), threads included; None once it has exited."""
        try:
            fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (AttributeError, OSError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_http(url: str, proc: Proc, timeout: float, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited while starting:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{proc.name}: no 200 from {url} within {timeout:.0f} s:\n{proc.tail()}")


# --- the replicas ---------------------------------------------------------------------------------


def replica_cmds(
    sizing: Sizing, tiers: bool, run_dir: Path, keys: Path | None = None
) -> list[tuple[str, int, list[str]]]:
    """(url, port, command) of each of the 2 replicas: bind-form KV events, one secret, the sized pool (with
    `keys`, an --api-keys file: the tenants of the shared-system-prompt workload)."""
    out = []
    for i in range(2):
        port, events = free_port(), free_port(pair=True)
        cmd = [sys.executable, "-m", "kvserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--kv-events-endpoint", f"tcp://*:{events}", "--cache-secret", SECRET]
        cmd += ["--kv-cache-memory", str(sizing.pool_bytes), "--kv-disk-size", "0", "--shutdown-timeout", "2"]
        cmd += ["--kv-disk-dir", str(run_dir / f"kv{i}")]  # never the user's shared default dir
        if tiers:
            cmd += ["--kv-host-memory", str(sizing.host_tier_bytes)]
        if keys is not None:
            cmd += ["--api-keys", str(keys)]
        out.append((f"http://127.0.0.1:{port}", port, cmd))
    return out


def start_replicas(sizing: Sizing, tiers: bool, run_dir: Path, keys: Path | None = None) -> list[tuple[str, Proc]]:
    groups = core_groups(2)
    replicas = []
    for i, (url, _, cmd) in enumerate(replica_cmds(sizing, tiers, run_dir, keys)):
        threads = str(len(groups[i]))  # torch sizes its pool by the machine's cores, not the affinity mask
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        proc = Proc(f"replica {i}", cmd, run_dir / f"replica{i}.log", groups[i], env)
        proc.start()
        replicas.append((url, proc))
    for url, proc in replicas:
        wait_http(f"{url}/health", proc, START_TIMEOUT_S)
    return replicas


# --- the routers ----------------------------------------------------------------------------------


def router_cmd(policy: str, urls: list[str], port: int, anchors: Path | None, extra: list[str]) -> list[str]:
    kind = POLICIES[policy][1]
    if kind == "kvserve":
        cmd = [sys.executable, "-m", "kvserve", "router", "--policy", policy, "--cache-secret", SECRET, *extra]
        return [*cmd, "--host", "127.0.0.1", "--port", str(port), *(a for u in urls for a in ("--replica", u))]
    if anchors is None:
        raise RuntimeError(f"{policy} needs --anchors or ${ANCHORS_ENV} (where setup.sh routers installed it)")
    venv = anchors / "router-venv" / "bin"
    if kind == "sglang":
        head = [str(venv / "python"), "-m", "sglang_router.launch_router"]
    else:
        head = [str(venv / "vllm-router")]
    if not Path(head[0]).exists():
        raise RuntimeError(f"{head[0]} is missing: run `ANCHORS={anchors} ../shared/anchors/setup.sh routers`")
    # never an --api-key: the client's Authorization header must reach the replicas
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware"]


def start_router(
    policy: str,
    urls: list[str],
    anchors: Path | None,
    run_dir: Path,
    extra: list[str],
    headers: dict[str, str] | None = None,
) -> tuple[str, Proc]:
    port = free_port()
    proc = Proc(f"router {policy}", router_cmd(policy, urls, port, anchors, extra), run_dir / "router.log")
    proc.start()
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v1/models", proc, ROUTER_TIMEOUT_S, headers)
    time.sleep(1.5)  # kvserve's router: its replicas discovered and their KV events subscribed
    return url, proc


# --- measuring ------------------------------------------------------------------------------------


def served_model(url: str, headers: dict[str, str] | None = None) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10, headers=headers).json()["data"][0]["id"]


def probe_ms(client: httpx.Client, url: str, model: str) -> float | str:
    """One max_tokens=1 completion, milliseconds (its TTFT: one token); the error text if it failed."""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed if response.status_code == 200 else f"HTTP {response.status_code}: {response.text[:300]}"


def added_latency(direct: list[str], routed: str, model: str, n: int) -> dict[str, Any]:
    """Median of n probes each way, interleaved so that the machine's load drifts alike for both; the direct
    ones take the replicas in turn, as the routed ones may (each replica has its own, unevenly shared, core)."""
    times: dict[str, list[float]] = {"direct": [], "routed": []}
    errors: list[str] = []
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            for name, url in (("direct", direct[i % len(direct)]), ("routed", routed)):
                got = probe_ms(client, url, model)
                (times[name].append(got) if isinstance(got, float) else errors.append(f"{name}: {got}"))
    out: dict[str, Any] = {"probes": n, "errors": errors[:3], "failed": len(errors)}
    for name, values in times.items():
        out[f"{name}_p50_ms"] = statistics.median(values) if values else None
    if out["direct_p50_ms"] is not None and out["routed_p50_ms"] is not None:
        out["added_p50_ms"] = out["routed_p50_ms"] - out["direct_p50_ms"]
    return out


def bench_cmd(cfg: BenchConfig, url: str, model: str, out_json: Path) -> list[str]:
    cmd = [sys.executable, "-m", "kvserve", "bench", "serve", "--base-url", url, "--model", model]
    cmd += ["--endpoint", "chat", "--workload", "multiturn", "--num-prompts", str(cfg.conversations)]
    cmd += ["--max-turns", str(cfg.turns), "--max-concurrency", str(cfg.concurrency), "--seed", str(cfg.seed)]
    return [*cmd, "--output-json", str(out_json), "--disable-tqdm"]


def reuse_bound(records: list[dict[str, Any]]) -> float | None:
    """The hit rate a perfect router could reach: each turn's prompt holds the previous turn's prompt and
    reply, which are all it can find cached (in whole blocks, less the last token: ~ a few % high)."""
    by_turn = {(r["session"], r["turn"]): r for r in records if r["success"]}
    prompts = sum(r["prompt_tokens"] for r in by_turn.values())
    reusable = 0
    for (session, turn), r in by_turn.items():
        if (prev := by_turn.get((session, turn - 1))) is not None:
            reusable += min(r["prompt_tokens"], prev["prompt_tokens"] + prev["output_tokens"])
    return reusable / prompts if prompts else None


def summarize(result: dict[str, Any], expected_turns: int) -> dict[str, Any]:
    """The figures the report compares, from `kvserve bench serve`'s JSON."""
    records = result.get("requests", [])
    errors: dict[str, int] = {}
    for r in records:
        if not r["success"]:
            errors[r["error"][:200]] = errors.get(r["error"][:200], 0) + 1
    return {
        "hit_rate": result["cached_token_ratio"],
        "reuse_bound": reuse_bound(records),
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "output_throughput": result["output_throughput"],
        "completed": result["completed"],
        "failed": result["failed"],
        # a failed turn ends its chat: the turns after it are never sent, and are lost too
        "unsent": max(0, expected_turns - len(records)),
        "input_tokens": result["total_input_tokens"],
        "cached_tokens": result["total_cached_tokens"],
        "duration_s": result["duration"],
        "errors": errors,
    }


def router_histograms(url: str) -> dict[str, Any]:
    """kvserve's router: its decision and tokenize(+hash) histograms, p99 as a bucket's upper bound."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, Any] = {}
    for name in ("kvserve:router_decision_seconds", "kvserve:router_tokenize_seconds"):
        buckets = []
        count = total = 0.0
        for line in text.splitlines():
            if line.startswith(f"{name}_bucket"):
                le = line.split('le="')[1].split('"')[0]
                buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
            elif line.startswith(f"{name}_count"):
                count = float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_sum"):
                total = float(line.rsplit(" ", 1)[1])
        p99 = next((le for le, n in sorted(buckets) if count and n >= 0.99 * count), None)
        short = name.split("router_")[1].removesuffix("_seconds")
        out[short] = {"count": count, "mean_ms": total / count * 1000 if count else None}
        out[short]["p99_le_ms"] = p99 * 1000 if p99 is not None and p99 != float("inf") else None
    return out


REPLICA_COUNTERS = ("request_success", "prompt_tokens", "generation_tokens", "prefix_cache_hits", "num_preemptions")


def replica_counters(url: str) -> dict[str, float]:
    """A replica's own totals (kvserve's /metrics, the probes before the benchmark included), to see how a
    router split the work."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = dict.fromkeys(REPLICA_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("kvserve:")
        if name in out:
            out[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def cpu_split(procs: dict[str, Proc], before: dict[str, float | None]) -> dict[str, float | None]:
    """CPU seconds each process spent since `before`."""
    out: dict[str, float | None] = {}
    for name, proc in procs.items():
        now, then = proc.cpu_seconds(), before.get(name)
        out[name] = None if now is None or then is None else now - then
    return out


def run_bench(cfg: BenchConfig, url: str, model: str, run_dir: Path, kill: Proc | None = None) -> dict[str, Any]:
    """`kvserve bench serve` as a subprocess; with `kill`, that replica gets SIGKILL kill_after_s in."""
    out_json = run_dir / "bench.json"
    bench = Proc("bench", bench_cmd(cfg, url, model, out_json), run_dir / "bench.log")
    bench.start()
    assert bench.popen is not None
    killed_at = None
    started = time.monotonic()
    while bench.alive():
        if kill is not None and killed_at is None and time.monotonic() - started >= cfg.kill_after_s:
            assert kill.popen is not None
            kill.popen.send_signal(signal.SIGKILL)
            killed_at = time.monotonic() - started
        if time.monotonic() - started > cfg.run_timeout_s:
            bench.popen.kill()
            raise RuntimeError(f"the benchmark ran past {cfg.run_timeout_s:.0f} s")
        time.sleep(0.5)
    if bench.popen.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"kvserve bench serve exited {bench.popen.returncode}:\n{bench.tail()}")
    result = json.loads(out_json.read_text())
    return {"result": result, "killed_at_s": killed_at}


def weight_variant(weight: float, round_: int) -> str:
    return f"weight{weight:g}-run{round_ + 1}"


def run_policy(cfg: BenchConfig, sizing: Sizing, policy: str, variant: str = "", weight: float | None = None) -> dict:
    """Fresh replicas, the policy's router, the added-latency probes, then the benchmark."""
    name = policy + (f"+{variant}" if variant else "")
    run_dir = cfg.work / name
    run: dict[str, Any] = {"policy": policy, "variant": variant, "label": POLICIES[policy][0], "ok": False}
    run["load_before"] = os.getloadavg()
    replicas: list[tuple[str, Proc]] = []
    router: Proc | None = None
    try:
        if variant == "system":
            run |= run_system(cfg, sizing, policy, run_dir)
            return run
        replicas = start_replicas(sizing, variant == "tiers", run_dir)
        model = served_model(replicas[0][0])
        extra = [] if weight is None else ["--kv-overlap-score-weight", f"{weight:g}"]
        url, router = start_router(policy, [u for u, _ in replicas], cfg.anchors, run_dir, extra)
        if variant != "kill":
            run["added_latency"] = added_latency([u for u, _ in replicas], url, model, cfg.probes)
        procs = {"router": router} | {f"replica {i}": proc for i, (_, proc) in enumerate(replicas)}
        cpu_before = {name: proc.cpu_seconds() for name, proc in procs.items()}
        got = run_bench(cfg, url, model, run_dir, kill=replicas[1][1] if variant == "kill" else None)
        run |= summarize(got["result"], sizing.turns) | {"killed_at_s": got["killed_at_s"], "ok": True}
        run["cpu_s"] = cpu_split(procs, cpu_before)
        run["replica_counters"] = [replica_counters(u) for u, _ in replicas]
        if POLICIES[policy][1] == "kvserve":
            run["router_histograms"] = router_histograms(url)
    except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as e:
        run["error"] = str(e)[-3000:]
        print(f"routers: {name} failed: {str(e)[-600:]}", file=sys.stderr, flush=True)
    finally:
        run["load_after"] = os.getloadavg()
        stop_all(router, replicas, run)
    return run


def run_system(cfg: BenchConfig, sizing: Sizing, policy: str, run_dir: Path) -> dict[str, Any]:
    """The shared-system-prompt workload (`system_prompt.py`) through the policy's router, on fresh replicas
    given the tenants' keys (a peer router passes the key through), their pools sized as for the multiturn
    one with each tenant's system prompt added to its working set once (its chats share it)."""
    from kvserve.config import DEFAULT_MODEL
    from kvserve.models.loader import resolve_model
    from kvserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    system = system_prompt(tokenizer, cfg.system_tokens)
    system_tokens = len(tokenizer.encode(system, add_special_tokens=False))
    chats = sample_chats(tokenizer, cfg.conversations, cfg.tenants, cfg.seed, cfg.turns)
    working = sizing.working_set_tokens + cfg.tenants * system_tokens
    pool, tokens = pool_for(working, sizing.working_set_ratio, sizing.bytes_per_token, sizing.block_size)
    sizing = dataclasses.replace(sizing, working_set_tokens=working, pool_bytes=pool, pool_tokens=tokens)
    run_dir.mkdir(parents=True, exist_ok=True)
    keys = write_system_keys(run_dir / "keys", cfg.tenants)
    headers = {"Authorization": f"Bearer {system_key(0)}"}
    replicas: list[tuple[str, Proc]] = []
    router: Proc | None = None
    out: dict[str, Any] = {"tenants": cfg.tenants, "system_tokens": system_tokens, "pool_tokens": tokens}
    try:
        replicas = start_replicas(sizing, False, run_dir, keys)
        model = served_model(replicas[0][0], headers)
        extra = ["--api-keys", str(keys)]
        url, router = start_router(policy, [u for u, _ in replicas], cfg.anchors, run_dir, extra, headers)
        procs = {"router": router} | {f"replica {i}": proc for i, (_, proc) in enumerate(replicas)}
        cpu_before = {name: proc.cpu_seconds() for name, proc in procs.items()}
        result = run_system_workload(url, model, system, chats, cfg.concurrency)
        (run_dir / "bench.json").write_text(json.dumps(result))
        out |= summarize_system(result, sum(len(c.user_turns) for c in chats), system_tokens) | {"ok": True}
        out["cpu_s"] = cpu_split(procs, cpu_before)
        out["replica_counters"] = [replica_counters(u) for u, _ in replicas]
        if POLICIES[policy][1] == "kvserve":
            out["router_histograms"] = router_histograms(url)
    finally:
        stop_all(router, replicas, out)
    return out


def stop_all(router: object | None, replicas: list, out: dict) -> None:
    """The router's last lines into `out`, then the router and every replica stopped."""
    if router is not None:
        out["router_log_tail"] = router.tail(8)
        router.stop()
    for _, proc in replicas:
        proc.stop()


# --- the routing decision, in process -------------------------------------------------------------


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": ordered[-1] * 1000}


def decision_micro(block_size: int, reps: int) -> dict[str, Any]:
    """kvserve.router's own key computation and cache_aware policy over two replicas whose indexes hold an
    8k-token prompt (all of it on one, half on the other), timed per request; tokenization timed apart."""
    from kvserve.config import DEFAULT_MODEL
    from kvserve.kv_cache.events import BlockStored
    from kvserve.models.loader import resolve_model
    from kvserve.router.policy import make_policy
    from kvserve.router.replicas import Replica, ServerInfo, State
    from kvserve.router.request import RoutedRequest, block_keys
    from kvserve.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer.from_dir(resolve_model(DEFAULT_MODEL))
    rng = random.Random(0)
    words = "the router hashes every block of a long prompt before it scores each replica".split()
    pieces = [rng.choice(words) + str(rng.randrange(1000)) for _ in range(DECISION_TOKENS)]
    ratio = DECISION_TOKENS / len(tokenizer.encode(" ".join(pieces)))  # words to tokens, then cut to ~8k tokens
    text = " ".join(pieces[: int(len(pieces) * ratio)])
    ids = tokenizer.encode(text)
    secret = SECRET.encode()
    keys = block_keys([ids], block_size, secret, "default", None)[0]
    info = ServerInfo("m", "m", "", block_size, 100_000, 16384, None, False)
    replicas = [Replica(i, f"http://r{i}", State.HEALTHY, info, subscriber=object()) for i in range(2)]
    replicas[0].events.apply([BlockStored(keys, None, [], block_size)])
    replicas[1].events.apply([BlockStored(keys[: len(keys) // 2], None, [], block_size)])
    policy = make_policy("cache_aware")
    tokenize, hashed, decide, cpu = [], [], [], []
    for i in range(reps):
        if i < 30:  # tokenization is the slow part, and reported apart: fewer repetitions
            t = time.perf_counter()
            tokenizer.encode(text)
            tokenize.append(time.perf_counter() - t)
        c0, t0 = time.thread_time(), time.perf_counter()
        request_keys = block_keys([ids], block_size, secret, "default", None)
        t1 = time.perf_counter()
        policy.choose(RoutedRequest("completion", {}, "default", None, [ids], request_keys), replicas)
        t2, c2 = time.perf_counter(), time.thread_time()
        hashed.append(t2 - t0)
        decide.append(t2 - t1)
        cpu.append(c2 - c0)  # this thread's CPU time: the work itself, without the time others' processes took the core
    return {
        "prompt_tokens": len(ids),
        "block_size": block_size,
        "reps": reps,
        "hashed_in": HASHED_IN,
        "hash_and_decision": _percentiles(hashed),
        "hash_and_decision_cpu": _percentiles(cpu),
        "decision_only": _percentiles(decide),
        "tokenize": _percentiles(tokenize) | {"reps": len(tokenize)},
        "load": os.getloadavg(),
    }


# --- the whole run --------------------------------------------------------------------------------


def size_workload(cfg: BenchConfig) -> Sizing:
    from kvserve.bench.conversations import sample_multiturn
    from kvserve.bench.prefix_cache import kv_bytes_per_token, working_set_tokens
    from kvserve.config import DEFAULT_MODEL, EngineConfig
    from kvserve.models.loader import load_config, resolve_model
    from kvserve.tokenizer import load_tokenizer

    model_dir = resolve_model(DEFAULT_MODEL)
    # the very chats `kvserve bench serve` samples: same sampler, count, seed and turns
    chats = sample_multiturn(load_tokenizer(model_dir), cfg.conversations, cfg.seed, cfg.turns)
    working = working_set_tokens(load_tokenizer(model_dir), chats)
    config = EngineConfig()
    per_token = kv_bytes_per_token(config, load_config(model_dir))
    pool, tokens = pool_for(working, cfg.working_set_ratio, per_token, config.block_size)
    turns = sum(len(c.user_turns) for c in chats)
    host = working * per_token * 2  # the whole working set, twice over: the tier never evicts here
    ratio = cfg.working_set_ratio
    return Sizing(cfg.conversations, turns, working, per_token, config.block_size, pool, tokens, ratio, host)


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.TimeoutExpired):
        cpu = platform.processor()
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()}


def run_all(cfg: BenchConfig, argv: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    sizing = size_workload(cfg)
    print(f"routers: {sizing}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python tools/routers " + " ".join(argv),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "sizing": asdict(sizing),
        "decision": decision_micro(sizing.block_size, cfg.decision_reps),
        "runs": [],
    }
    jobs: list[tuple[str, str, float | None]] = [(p, "", None) for p in cfg.policies]
    jobs += [("cache_aware", "tiers", None)] if cfg.tiers_on else []
    jobs += [("cache_aware", "kill", None)] if cfg.kill else []
    jobs += [("cache_aware", weight_variant(w, i), w) for i in range(cfg.weight_rounds) for w in cfg.weights]
    jobs += [(p, "system", None) for p in cfg.policies] if cfg.system_prompt else []
    for policy, variant, weight in jobs:
        print(f"routers: {policy} {variant} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        report["runs"].append(run_policy(cfg, sizing, policy, variant, weight))
        write_report(report, cfg.out)  # after every run: a long run interrupted still leaves its figures
    report["wall_s"] = time.monotonic() - started
    write_report(report, cfg.out)
    return report


def resummarize(report: dict[str, Any], work: Path) -> dict[str, Any]:
    """--render-only: each run's figures again from its client JSON under --work, where it is still there."""
    for run in report["runs"]:
        bench = work / (run["policy"] + (f"+{run['variant']}" if run["variant"] else "")) / "bench.json"
        if run["ok"] and bench.exists() and run["variant"] == "system":
            expected = run["completed"] + run["failed"] + run["unsent"]
            run |= summarize_system(json.loads(bench.read_text()), expected, run["system_tokens"])
        elif run["ok"] and bench.exists():
            run |= summarize(json.loads(bench.read_text()), report["sizing"]["turns"])
    return report


def parse_args(argv: list[str]) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python tools/routers", description=__doc__.split("\n\n")[0])
    d = BenchConfig(out=Path("docs/bench-routers"), anchors=None)
    p.add_argument("--out", type=Path, default=d.out, help="the report: OUT.md and OUT.json")
    p.add_argument("--work", type=Path, default=d.work, help="scratch: each run's logs and benchmark JSON")
    p.add_argument("--anchors", type=Path, default=None, help=f"where setup.sh installed the routers (${ANCHORS_ENV})")
    p.add_argument("--policies", default=",".join(d.policies), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns, help="user turns per chat, at most")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="chats in flight")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--working-set-ratio", type=float, default=d.working_set_ratio)
    p.add_argument("--probes", type=int, default=d.probes, help="max_tokens=1 requests each way (added latency)")
    p.add_argument("--decision-reps", type=int, default=d.decision_reps)
    p.add_argument("--no-tiers-on", action="store_true", help="skip kvserve cache_aware with a host tier")
    p.add_argument("--no-kill", action="store_true", help="skip the run that SIGKILLs a replica")
    p.add_argument("--kill-after", type=float, default=d.kill_after_s, help="seconds into the kill run")
    p.add_argument("--no-system-prompt", action="store_true", help="skip the shared-system-prompt workload")
    p.add_argument("--tenants", type=int, default=d.tenants, help="shared-system-prompt workload: API keys")
    p.add_argument(
        "--system-tokens", type=int, default=d.system_tokens, help="shared-system-prompt workload: its length"
    )
    p.add_argument(
        "--weights", default="", help="comma list: kvserve cache_aware again at each --kv-overlap-score-weight"
    )
    p.add_argument("--weight-rounds", type=int, default=d.weight_rounds, help="the --weights runs, alternated, N times")
    p.add_argument("--render-only", action="store_true", help="the report again from OUT.json")
    p.add_argument("--decision-only", action="store_true", help="the decision micro-measure again, into OUT.json")
    a = p.parse_args(argv)
    policies = tuple(x.strip() for x in a.policies.split(",") if x.strip())
    if unknown := [x for x in policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    anchors = a.anchors or (Path(os.environ[ANCHORS_ENV]) if os.environ.get(ANCHORS_ENV) else None)
    cfg = BenchConfig(a.out, anchors, a.work, policies, a.conversations, a.turns, a.concurrency, a.seed)
    cfg.working_set_ratio, cfg.probes, cfg.decision_reps = a.working_set_ratio, a.probes, a.decision_reps
    cfg.tiers_on, cfg.kill, cfg.kill_after_s = not a.no_tiers_on, not a.no_kill, a.kill_after
    cfg.render_only, cfg.decision_only = a.render_only, a.decision_only
    cfg.weights = tuple(float(x) for x in a.weights.split(",") if x.strip())
    cfg.weight_rounds = a.weight_rounds
    cfg.system_prompt, cfg.tenants, cfg.system_tokens = not a.no_system_prompt, a.tenants, a.system_tokens
    return cfg


def main() -> None:
    argv = sys.argv[1:]
    cfg = parse_args(argv)
    if cfg.decision_only:  # measured again (e.g. on a quieter machine) into the existing report
        report = json.loads(cfg.out.with_suffix(".json").read_text())
        report["decision"] = decision_micro(report["sizing"]["block_size"], cfg.decision_reps)
        write_report(report, cfg.out)
        return
    if cfg.render_only:
        write_report(resummarize(json.loads(cfg.out.with_suffix(".json").read_text()), cfg.work), cfg.out)
        return
    run_all(cfg, argv)
    print(f"routers: report in {cfg.out}.md", file=sys.stderr)
