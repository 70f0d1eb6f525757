"""A starting worker: online (and saying so) while it loads, consuming eagerly while it compiles,
stopped by SIGTERM either way. Real Redis, real `specbatch worker` processes (prefork, spawned
child); hooks in the pool child hold loading / compiling as long as a test needs."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from specbatch.db import database_id
from specbatch.worker import monitor, scratch
from specbatch.worker.monitor import active_queues, queue_workers
from tests.worker.conftest import CLI
from tests.worker.services import Proc, get_json, wait_for

pytestmark = pytest.mark.slow   # each starts a worker: spawning its child alone is seconds here


def _worker(cluster, name: str, *hooks: str, compile_: str = "off") -> Proc:  # noqa: ANN001
    argv = [sys.executable, "-m", "tests.worker.entry", *(a for h in hooks for a in ("--imports", h)), "--compile", compile_,
            "--target", str(cluster.models / "llama"), "--draft", str(cluster.models / "llama-partial"),
            "-n", f"{name}@%h"]
    proc = Proc(argv, cluster.env, cluster.tmp / f"worker-{name}.log")
    cluster.procs.append(proc)
    return proc


def _state(cluster, proc: Proc, prefix: str) -> str | None:  # noqa: ANN001
    """This worker's announced state once it starts with ``prefix``."""
    if proc.proc.poll() is not None:
        raise AssertionError(f"worker exited {proc.proc.returncode}:\n{proc.output()[-3000:]}")
    views = queue_workers(cluster.settings, cluster.queue(), timeout=0.5) or []
    return next((v.state for v in views if v.state and v.state.startswith(prefix)), None)


@pytest.fixture
def gate(cluster):  # noqa: ANN001, ANN201
    path = cluster.tmp / "gate"
    cluster.env["SPECBATCH_TEST_GATE"] = str(path)
    return path


def test_a_loading_worker_is_online_says_so_and_consumes_once_loaded(cluster, gate) -> None:  # noqa: ANN001
    proc = _worker(cluster, "w1", "tests.worker.gated_load_hook")
    assert wait_for(lambda: _state(cluster, proc, "starting"), 120, "the worker to announce itself") == \
        "starting: loading models"
    view = next(v for v in queue_workers(cluster.settings, cluster.queue()) or [] if v.name.startswith("w1@"))
    assert not view.consuming      # online, not consuming: nothing is taken before the models are there
    # the worker answers status's one broadcast itself (worker.panel), not through the two built-in commands
    # (asked until it answers: a worker busy loading on a loaded 2-core machine missed a 1 s broadcast)
    reply = wait_for(lambda: next((r for w, r in (monitor._inspect(cluster.settings, monitor.VIEW_COMMAND, 1.0)
                                                  or {}).items() if w.startswith("w1@")), None),
                     60, "the loading worker to answer status's broadcast")
    assert reply == {"queues": [], "default_queue": cluster.queue(), "state": "starting: loading models",
                     "database": database_id(cluster.settings.database_url)}    # (its database's id)

    # what a user sees: the worker is starting, not "no live worker ... start one"
    job_id, _ = cluster.submit([{"custom_id": "a", "prompt": "hi", "max_tokens": 3}])
    out = subprocess.run([*CLI, "status", job_id], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"is starting for queue {cluster.queue()} (starting: loading models)" in out.stderr, out.stderr
    assert "no live worker" not in out.stderr, out.stderr
    # the same job seen through another Redis db: this worker never takes its tasks there (a
    # new-user walk: `status` named a worker of db 7 for a job submitted on db 8)
    other = {**cluster.env, "SPECBATCH_BROKER_URL": cluster.redis.url.removesuffix("/0") + "/8"}
    out = subprocess.run([*CLI, "status", job_id], env=other, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"no live worker consumes queue {cluster.queue()}" in out.stderr and "w1@" not in out.stderr, out.stderr

    gate.touch()
    cluster.wait_consuming(proc)
    assert cluster.wait_finished(job_id)["status"] == "completed"
    assert wait_for(lambda: _state(cluster, proc, "ready"), 30, "the ready state") == "ready (eager)"
    assert [r["queues"] for w, r in (monitor._inspect(cluster.settings, monitor.VIEW_COMMAND, 1.0) or {}).items()
            if w.startswith("w1@")] == [[cluster.queue()]]


def test_sigterm_stops_a_worker_while_it_loads(cluster, gate) -> None:  # noqa: ANN001
    """Before: "Warm shutdown", then the parent waited for the loading child forever."""
    proc = _worker(cluster, "w1", "tests.worker.gated_load_hook")
    wait_for(lambda: _state(cluster, proc, "starting"), 120, "the worker to announce itself")
    child = proc.pool_children()
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]      # the bound is generous; measured ~3-5 s
    assert not any(_alive(pid) for pid in child), child


@pytest.mark.parametrize("moment", ["import", "pool"])
def test_sigterm_at_any_moment_of_the_start_up_stops_the_worker_cleanly(cluster, gate, moment) -> None:  # noqa: ANN001
    """The test above flaked at load 10: SIGTERM came once the worker's scratch directory said
    "starting", before Celery had installed its handler ("import"), and the worker died by the
    default action (exit -15, no output). Signalled after the handler but before the consumer
    started ("pool"), the worker waited forever for the child loading its models. Held at each
    moment by a hook and signalled there."""
    held = cluster.tmp / "held"
    cluster.env.update(SPECBATCH_TEST_HOLD=moment, SPECBATCH_TEST_HELD=str(held))
    proc = _worker(cluster, "w1", "tests.worker.gated_load_hook", "tests.worker.held_start_hook")
    wait_for(lambda: held.exists() or proc.proc.poll() is not None, 120, "the start-up to be held")
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    wait_for(lambda: not _session_alive(proc.pid), 10, "the pool child to end")
    assert not (scratch.workers_root(cluster.settings) / str(proc.pid)).exists()   # no "starting" left behind


def _session_alive(sid: int) -> list[str]:
    """The processes of the worker's session (its pool child, billiard's tracker) not yet ended."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(sid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1][0] not in "ZX"]


def test_a_compiling_worker_consumes_eagerly_shows_progress_and_stops_on_sigterm(cluster) -> None:  # noqa: ANN001
    """Before: compiling ran before the worker consumed (31 minutes for the default pair) and a
    SIGTERM then left it alive."""
    proc = _worker(cluster, "w1", "tests.worker.stuck_compile_hook", compile_="on")
    cluster.wait_consuming(proc)
    state = wait_for(lambda: _state(cluster, proc, "compiling"), 60, "the compiling state")
    assert state.startswith("compiling 1/4 (") and state.endswith("decoding eagerly until then"), state

    job_id, _ = cluster.submit([{"custom_id": "a", "prompt": "hi", "max_tokens": 3}])
    assert cluster.wait_finished(job_id)["status"] == "completed"      # eagerly, while compiling
    out = subprocess.run([*CLI, "status", job_id], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no live worker" not in out.stderr, out.stderr

    child = proc.pool_children()
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-3000:]
    assert not any(_alive(pid) for pid in child), child
    assert not (active_queues(cluster.settings, timeout=0.5) or {})


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
    return state not in ("Z", "X")


def test_flower_shows_the_starting_worker_its_state_and_the_pair_queue_holding_tasks(cluster, gate) -> None:  # noqa: ANN001
    """Before: "No workers are available" while the worker loaded or compiled, and the Broker tab
    listed only specbatch.default while the job's tasks waited in the pair queue."""
    import requests

    flower, port = cluster.flower(password="s3cret")
    job_id, _ = cluster.submit([{"custom_id": "a", "prompt": "hi", "max_tokens": 3}])
    proc = _worker(cluster, "w1", "tests.worker.gated_load_hook")
    wait_for(lambda: _state(cluster, proc, "starting"), 120, "the worker to announce itself")
    base, auth = f"http://127.0.0.1:{port}", ("admin", "s3cret")
    assert wait_for(lambda: get_json(base + "/healthcheck", None) is not None, 60, "flower to start")

    def starting() -> dict | None:
        workers = get_json(base + "/api/workers?refresh=1", auth) or {}
        return next((w for name, w in workers.items() if name.startswith("w1@")
                     and (w.get("conf") or {}).get("specbatch_state")), None)
    worker = wait_for(starting, 60, "flower to list the starting worker with its state")
    assert worker["conf"]["specbatch_state"] == "starting: loading models", worker["conf"]

    page = requests.get(base + "/broker", auth=auth, timeout=10)
    assert page.status_code == 200 and cluster.queue() in page.text, page.text[-2000:]
    gate.touch()
    assert cluster.wait_finished(job_id)["status"] == "completed"
