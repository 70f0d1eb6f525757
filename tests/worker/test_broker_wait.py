"""A worker started while the broker is down: one line naming it (password masked), a line at most
every 10 s while it waits, then it starts once the broker answers, or exits 1 after
SPECBATCH_BROKER_WAIT_SECONDS. Celery's own start-up retries printed several lines a try for
minutes. Unit tests with a fake clock; real `specbatch worker` processes against a real Redis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specbatch.config import Settings
from specbatch.errors import BrokerUnavailable
from specbatch.worker.enqueue import wait_for_broker
from tests.worker.conftest import CLI
from tests.worker.services import REPO, Proc, RedisServer, free_port, wait_for

SECRET = "pw-s3cret-Zq"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _down_until(clock: Clock, up_at: float):  # noqa: ANN202
    def check(settings: Settings) -> None:
        clock.now += 0.1       # a refused connection takes a moment
        if clock.now < up_at:
            try:
                raise ConnectionRefusedError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
            except ConnectionRefusedError as e:
                raise BrokerUnavailable("unreachable") from e
    return check


def _settings(wait: float) -> Settings:
    return Settings.from_env({"SPECBATCH_BROKER_URL": f"redis://:{SECRET}@127.0.0.1:1/0",
                              "SPECBATCH_BROKER_WAIT_SECONDS": str(wait), "SPECBATCH_DATABASE_URL": "sqlite://"})


def test_a_broker_that_comes_up_is_waited_for_with_a_line_at_most_every_10s() -> None:
    clock, lines = Clock(), []
    wait_for_broker(_settings(120), lines.append, clock=clock, sleep=clock.sleep, check=_down_until(clock, 45))
    assert 45 <= clock.now < 48                     # tried every 2 s: started soon after it came up
    assert lines[0] == ("cannot reach the broker at redis://:***@127.0.0.1:1/0 (Error 111 connecting to "
                        "127.0.0.1:1. Connection refused.); waiting up to 120s for it "
                        "(SPECBATCH_BROKER_WAIT_SECONDS), trying every 2s")
    waited = [int(line.removeprefix("still no broker after ").split("s of ")[0]) for line in lines[1:-1]]
    assert len(waited) == 4 and all(b - a >= 10 for a, b in zip([0, *waited], waited)), lines
    assert all(line.endswith(" of 120s") for line in lines[1:-1]), lines
    assert lines[-1] == f"the broker answers after {clock.now:.0f}s; starting"


def test_a_broker_that_stays_down_ends_the_wait_with_one_masked_error() -> None:
    clock, lines = Clock(), []
    with pytest.raises(BrokerUnavailable) as e:
        wait_for_broker(_settings(30), lines.append, clock=clock, sleep=clock.sleep, check=_down_until(clock, 1e9))
    assert 30 <= clock.now < 31
    assert str(e.value).startswith("cannot reach the broker at redis://:***@127.0.0.1:1/0 (Error 111")
    assert "after waiting 30s" in str(e.value)
    assert len(lines) == 3 and not any(SECRET in x for x in [*lines, str(e.value)])


def test_a_broker_that_answers_says_nothing() -> None:
    clock, lines = Clock(), []
    wait_for_broker(_settings(30), lines.append, clock=clock, sleep=clock.sleep, check=lambda s: None)
    assert lines == [] and clock.now == 0


@pytest.mark.slow
def test_a_worker_started_with_the_broker_down_says_so_once_and_exits_1(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO),
           "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}",
           "SPECBATCH_BROKER_URL": f"redis://:{SECRET}@127.0.0.1:{free_port()}/0",
           "SPECBATCH_BROKER_WAIT_SECONDS": "3"}
    out = subprocess.run([*CLI, "worker", "--target", "smollm2-135m", "--no-speculation"], env=env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert SECRET not in text and "Trying again" not in text and "Traceback" not in text, text
    assert text.count("cannot reach the broker at redis://:***@127.0.0.1:") == 2, text   # waiting, gave up
    assert "after waiting" in text, text
    assert len(text.strip().splitlines()) <= 3, text


@pytest.mark.slow
def test_sigterm_while_a_worker_waits_for_the_broker_exits_0_quietly(tmp_path: Path) -> None:
    """Killed by the default action before: exit -15 (a start-up stopped is not a failure)."""
    import signal

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}",
           "SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0", "SPECBATCH_BROKER_WAIT_SECONDS": "300"}
    proc = Proc([*CLI, "worker", "--target", "smollm2-135m", "--no-speculation"], env, tmp_path / "worker.log")
    try:
        wait_for(lambda: "waiting up to 300s" in proc.output(), 120, "the worker to say it waits for the broker")
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.output()
        assert "Traceback" not in proc.output(), proc.output()
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_worker_started_before_the_broker_consumes_once_it_is_up(tmp_path: Path, tiny_models: Path) -> None:
    from specbatch.worker.monitor import active_queues
    from specbatch.worker.queues import queue_name

    redis = RedisServer(tmp_path)          # not started yet: its port refuses connections
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'sb.db'}", "SPECBATCH_BROKER_URL": redis.url,
           "SPECBATCH_BROKER_WAIT_SECONDS": "300"}
    target, draft = str(tiny_models / "llama"), str(tiny_models / "llama-partial")
    proc = Proc([sys.executable, "-c", "from specbatch.cli.main import main; main()", "worker", "--target", target,
                 "--draft", draft, "-n", "late@%h"], env, tmp_path / "worker.log")
    try:
        wait_for(lambda: "waiting up to 300s" in proc.output(), 120, "the worker to say it waits for the broker")
        redis.start()
        settings = Settings.from_env(env)
        queue = queue_name(target, [draft])

        def consuming() -> bool:
            assert proc.proc.poll() is None, proc.output()[-3000:]
            return any(queue in qs for qs in (active_queues(settings, timeout=0.5) or {}).values())
        wait_for(consuming, 180, "the worker to consume once the broker is up")
        text = proc.output()
        assert "the broker answers after" in text and "Trying again" not in text, text
    finally:
        proc.stop()
        redis.stop()


def test_no_wait_asked_says_so_rather_than_a_wait_it_did_not_do() -> None:
    # SPECBATCH_BROKER_WAIT_SECONDS=0 is "no wait": the refused try's own moment is not a wait
    clock, lines = Clock(), []
    with pytest.raises(BrokerUnavailable) as e:
        wait_for_broker(_settings(0), lines.append, clock=clock, sleep=clock.sleep, check=_down_until(clock, 1e9))
    assert lines == [] and "after waiting" not in str(e.value)
    assert "SPECBATCH_BROKER_WAIT_SECONDS=0: no wait" in str(e.value)
