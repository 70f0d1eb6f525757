"""Flower's basic auth on both ways README.md starts it ("Cluster setup")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import requests

from tests.worker.services import REPO, Proc, RedisServer, free_port, wait_for


@pytest.mark.integration
def test_celery_flower_command_asks_for_the_password_too(tmp_path: Path,
                                                          redis_server: RedisServer) -> None:
    """`celery -A specbatch.worker.flower flower` with SPECBATCH_FLOWER_PASSWORD set ran with no
    authentication: only `specbatch flower` turned the password into Flower's FLOWER_BASIC_AUTH."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env.update({"SPECBATCH_BROKER_URL": redis_server.url, "SPECBATCH_FLOWER_PASSWORD": "s3cret",
                "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}", "PYTHONPATH": str(REPO)})
    flower = Proc([sys.executable, "-m", "celery", "-A", "specbatch.worker.flower", "flower",
                   f"--port={port}", "--address=127.0.0.1"], env, tmp_path / "flower.log")
    base = f"http://127.0.0.1:{port}"
    try:
        def answers() -> bool:
            assert flower.proc.poll() is None, flower.output()
            try:
                return requests.get(base + "/healthcheck", timeout=5).ok
            except requests.RequestException:
                return False
        wait_for(answers, 60, "flower to start")
        # the pages, not /api/...: Flower 2 refuses its API to anyone while no auth is configured
        assert requests.get(base + "/workers", timeout=10).status_code == 401
        assert requests.get(base + "/workers", auth=("admin", "s3cret"), timeout=10).ok
        assert requests.get(base + "/api/workers", auth=("admin", "s3cret"), timeout=10).ok
    finally:
        flower.stop()


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),            # kombu wrote redis://:**@...
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://u:s3cret@h:6379/0", "redis://u:***@h:6379/0"),
])
def test_flowers_broker_url_is_masked_only_where_it_has_a_password(url: str, shown: str) -> None:
    from types import SimpleNamespace

    pytest.importorskip("flower")
    from flower.app import Flower

    # Flower's own broker_uri, unpatched: the app's connection class masks (worker.app.ShownConnection)
    from specbatch.config import Settings
    from specbatch.worker.app import create_app

    app = create_app(Settings.from_env({"SPECBATCH_BROKER_URL": url}))
    assert Flower.broker_uri.func(SimpleNamespace(capp=app)) == shown
