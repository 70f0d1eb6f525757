"""A Redis password given as ``?password=`` (which redis-py reads) works with kombu too: the broker
URL is rewritten at config time with the password in its user part. kombu failed on such a URL
with "got multiple values for keyword argument 'password'" (issue 32). Real redis-server."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from specbatch.config import Settings
from specbatch.errors import SettingsError
from specbatch.worker.enqueue import check_broker
from tests.worker.services import _serves, free_port, wait_for

PASSWORD = "p@ss/w:rd%x ü"


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[int]:
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", PASSWORD],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password=PASSWORD)
        wait_for(lambda: _serves(client, proc.pid), 10, "redis-server to answer")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_password_as_a_query_parameter_reaches_the_broker(locked_redis: int) -> None:
    url = f"redis://127.0.0.1:{locked_redis}/0?password={quote(PASSWORD, safe='')}"
    settings = Settings.from_env({"SPECBATCH_BROKER_URL": url})
    check_broker(settings, timeout=3)            # raised TypeError inside kombu before
    assert "password=" not in settings.broker_url
    wrong = Settings.from_env({"SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{locked_redis}/0?password=nope"})
    with pytest.raises(Exception) as e:
        check_broker(wrong, timeout=2)
    assert "nope" not in str(e.value)


def test_a_password_given_twice_is_refused_at_config_time_masked() -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"SPECBATCH_BROKER_URL": "redis://:s3cretA@h:6379/0?password=s3cretB"})
    assert "twice" in str(e.value) and "s3cret" not in str(e.value)
