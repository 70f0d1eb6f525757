"""The test harness's own redis-server (tests/worker/services.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.worker import services


def test_a_port_taken_before_redis_binds_it_moves_to_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port frees the port it found before redis-server binds it; another process may take it
    in between. The server then exited, and the start waited 10 s and failed the test (or found
    another test's server answering there)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = services.free_port
    monkeypatch.setattr(services, "free_port", lambda: next(ports, None) or real())
    server = services.RedisServer(tmp_path).start()
    try:
        assert server.port != taken.getsockname()[1]
        assert services._serves(server.client(), server.proc.pid)
    finally:
        server.stop()
        taken.close()
