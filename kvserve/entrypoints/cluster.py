"""`kvserve serve --replicas N`: N replicas on this machine, each pinned to its share of the cores, behind a router.

The replicas are `kvserve serve` child processes on free loopback ports, each publishing
KV events on its own port, all keyed by one cache secret so that the router (run in this
process, which never loads torch) computes the same block keys. Children are in their
own process group, so Ctrl-C reaches this process only and shuts them down in order, and
they get SIGKILL from the kernel if this process dies without doing so (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.router.args import POLICIES, add_local_prefill_arg

START_TIMEOUT = 900.0  # seconds for a replica's /health: a large model loads (and its kernels build) first
STOP_TIMEOUT = 40.0  # seconds between SIGTERM and SIGKILL: a replica drains for --shutdown-timeout (30 s)
LOG_LINES = 30  # a failed replica's last lines, shown in the error
# the router polls these every 0.5 s: relayed, they would bury every other line
QUIET = ('"GET /health HTTP', '"GET /metrics HTTP', '"GET /server_info HTTP')
PR_SET_PDEATHSIG = 1
# flags each replica gets from here, not from the user's command line
OWN_FLAGS = ("replicas", "router_policy", "host", "port", "model_tag", "kv_events_endpoint", "cache_secret", "pd")
OWN_FLAGS += ("role",)  # with --pd, set per replica
OWN_FLAGS += ("max_local_prefill_tokens",)  # the router's
OWN_FLAGS += ("kv_events_replay_endpoint",)  # default: its events port + 1, which free_port(pair=True) keeps free


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="start this many replicas on this machine, each on its share of the cores, behind a router on "
        "--host/--port (1: one server, no router)",
    )
    parser.add_argument("--router-policy", choices=POLICIES, default="cache_aware", help="with --replicas N > 1")
    parser.add_argument(
        "--pd",
        action="store_true",
        help="with --replicas N > 1: the first half prefill replicas, the rest decode replicas (prefill/decode "
        "disaggregation), the router sending a prompt with much to compute to a prefill replica first",
    )
    add_local_prefill_arg(parser)  # with --pd: the router's


def core_groups(n: int) -> list[list[int]]:
    """This process's CPUs in n disjoint groups of whole physical cores (hyperthread siblings stay together)."""
    by_core: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        by_core.setdefault(_physical_core(cpu), []).append(cpu)
    cores = list(by_core.values())
    if len(cores) < n:
        raise ValueError(f"--replicas {n} needs at least {n} physical cores; this process may use {len(cores)}")
    return [[cpu for core in cores[i * len(cores) // n : (i + 1) * len(cores) // n] for cpu in core] for i in range(n)]


def _physical_core(cpu: int) -> tuple[str, str]:
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:  # no sysfs (a container may hide it): each CPU its own core
        return "cpu", str(cpu)


def free_port(pair: bool = False) -> int:
    """A free loopback port (with `pair`, the next one free too: a replica's events and their replay)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def replica_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The engine and server flags the user gave (those off their defaults), as a replica's command line."""
    flags: list[str] = []
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        if action.dest in OWN_FLAGS or not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value == parser.get_default(action.dest):
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreConstAction):  # store_true / store_false
            flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags


def _die_with_parent(parent: int, cpus: list[int]) -> None:
    """In the child before exec: SIGKILL when this process dies, even by SIGKILL, and run on `cpus` only."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(1)
    if os.getppid() != parent:  # the parent died before the prctl: nobody would have killed this child
        os._exit(1)
    os.sched_setaffinity(0, cpus)


@dataclass
class Replica:
    index: int
    cpus: list[int]
    cmd: list[str]
    url: str
    role: str = "both"
    proc: subprocess.Popen | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))

    def start(self) -> None:
        # torch sizes its thread pool by the cores it sees, not by the affinity mask: tell it this replica's share
        threads = str(len({_physical_core(c) for c in self.cpus}))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        parent = os.getpid()
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0,  # Ctrl-C at the terminal reaches the parent only, which stops the replicas in order
            preexec_fn=lambda: _die_with_parent(parent, self.cpus),
        )
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        """Its output on our stderr, each line prefixed, the last ones kept for an error message."""
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if any(q in line for q in QUIET):
                continue
            self.tail.append(line)
            print(f"[replica {self.index}] {line}", file=sys.stderr, flush=True)

    def healthy(self) -> bool:
        import httpx  # here: cli.py imports this module for its flags, and `kvserve --help` stays light

        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def failure(self, why: str) -> RuntimeError:
        time.sleep(0.2)  # let the relay thread read the last lines the replica wrote
        lines = "\n".join(f"    {line}" for line in self.tail)
        return RuntimeError(f"replica {self.index} ({self.url}, cores {self.cpus}) {why}; its last lines:\n{lines}")


def replicas_for(args: argparse.Namespace, parser: argparse.ArgumentParser, secret: str) -> list[Replica]:
    base = [sys.executable, "-m", "kvserve", "serve", *replica_flags(args, parser), "--cache-secret", secret]
    out = []
    for i, cpus in enumerate(core_groups(args.replicas)):
        port, events = free_port(), free_port(pair=True)
        # a wildcard host: a replica publishes on a loopback address only where its --host is one, which it is
        cmd = [*base, "--host", "127.0.0.1", "--port", str(port), "--kv-events-endpoint", f"tcp://*:{events}"]
        role = pd_role(i, args.replicas) if args.pd else args.role
        out.append(Replica(i, cpus, [*cmd, "--role", role], f"http://127.0.0.1:{port}", role=role))
    return out


def pd_role(index: int, n: int) -> str:
    """With --pd: the first half of the replicas prefill (at least one), the rest decode (at least one)."""
    return "prefill" if index < max(1, n // 2) else "decode"


def wait_healthy(replicas: list[Replica], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(replicas)
    while waiting:
        for r in list(waiting):
            assert r.proc is not None
            if r.proc.poll() is not None:
                raise r.failure(f"exited with status {r.proc.returncode} while starting")
            if r.healthy():
                waiting.remove(r)
        if waiting and time.monotonic() > deadline:
            raise waiting[0].failure(f"did not answer /health within {timeout:.0f} s")
        time.sleep(0.2)


def stop_all(replicas: list[Replica]) -> None:
    """SIGTERM to every replica at once (each drains), SIGKILL to any still running after STOP_TIMEOUT."""
    running = [r.proc for r in replicas if r.proc is not None and r.proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cluster_secret(args: argparse.Namespace) -> str:
    """--cache-secret, else what one server would use (Redis needs it given; the disk tier keeps one), else random."""
    if args.cache_secret:
        return args.cache_secret
    from kvserve.engine_args import engine_config
    from kvserve.server.auth import server_cache_secret

    return server_cache_secret(None, engine_config(args)).hex()


def router_args(args: argparse.Namespace, replicas: list[Replica], secret: str) -> argparse.Namespace:
    from kvserve.router.args import add_router_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    flag = {"both": "--replica", "prefill": "--prefill", "decode": "--decode"}
    argv = [a for r in replicas for a in (flag[r.role], r.url)]
    argv += ["--policy", args.router_policy, "--host", args.host, "--port", str(args.port), "--cache-secret", secret]
    argv += ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
    argv += ["--api-keys", args.api_keys] if args.api_keys else []
    argv += ["--api-key", args.api_key] if args.api_key else []
    return parser.parse_args(argv)


def _listen(host: str, port: int) -> socket.socket:
    """The router's socket, bound before its URL is printed: connections from then on wait, none is refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds to the finally that stops the replicas


def serve_parser() -> argparse.ArgumentParser:
    """`kvserve serve`'s flags, as cli.py adds them: what a replica's command line is rebuilt from."""
    from kvserve.engine_args import add_engine_args
    from kvserve.server.args import add_server_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    add_cluster_args(parser)
    return parser


def run_cluster(args: argparse.Namespace) -> None:
    from kvserve.router.app import create_router

    secret = cluster_secret(args)
    replicas = replicas_for(args, serve_parser(), secret)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        sock = _listen(args.host, args.port)  # the router's port is checked before any replica loads a model
        args.port = sock.getsockname()[1]  # --port 0: the one the system chose
        for r in replicas:
            r.start()
        wait_healthy(replicas)
        router = create_router(router_args(args, replicas, secret))
        urls = ", ".join(r.url if r.role == "both" else f"{r.url} ({r.role})" for r in replicas)
        print(f"kvserve: router on http://{args.host}:{args.port} -> replicas {urls}", flush=True)
        router.run(sockets=[sock])  # uvicorn drains on SIGINT/SIGTERM, then re-raises it: to the finally below
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        pass
    finally:
        stop_all(replicas)
        signal.signal(signal.SIGTERM, previous)
