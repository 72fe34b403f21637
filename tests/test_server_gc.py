"""`kvserve serve` hides start-up's objects from the cycle collector before it serves."""

from __future__ import annotations

import gc

from kvserve.server import api_server


class _Server:
    frozen_when_run: int | None = None

    def run(self) -> None:
        self.frozen_when_run = gc.get_freeze_count()


def test_start_up_objects_are_frozen_before_the_server_runs(monkeypatch):
    server = _Server()
    monkeypatch.setattr(api_server, "create_server", lambda args: server)
    gc.unfreeze()
    try:
        api_server.run_server(None)
    finally:
        gc.unfreeze()  # the rest of the test session's objects stay collectable
    assert server.frozen_when_run and server.frozen_when_run > 1000
