"""How long a real `specbatch worker` takes from its start to its first claimed request.

Issue 31's goal: at most 60 s on a warm cache, 90 s on a cold one. Each start is a real worker
process (the CLI's `specbatch worker`, prefork with its spawned child) against Redis and a SQLite
or PostgreSQL database. A job of one short request is submitted first (`specbatch submit`, its
own fresh SQLite file per start unless --database-url is given); the worker is then started, and
its first claim is the request's ``started_at`` in the database, minus the time the worker
process was started. While it starts, the script asks the broker what `specbatch status` shows
(the worker's announced state: "starting: loading models", then "compiling ..." / "eager: ..."),
and notes when each state was first seen.

- cold: a fresh HOME (no SPECBATCH_CACHE_DIR, XDG or inductor cache: the default model is
  dequantized from its GGUF again, inductor starts empty); the OS page cache and Python's
  bytecode stay warm, as on any machine that ran Python before.
- warm: a second start with the same HOME, right after the cold one.

Per --compile mode and round: cold, then warm. Each start is bounded (--timeout): the worker
gets SIGTERM once its job finished (or the bound passed), SIGKILL 30 s later. Not run by the
tests (minutes). Usage (docs/COMPILE.md, "Worker start-up time"):

    PYTHONPATH=$PWD nice -n 5 python scripts/worker_start.py --rounds 2 --compile auto,on
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SPECBATCH = [sys.executable, "-c", "from specbatch.cli.main import main; main()"]
PROMPT = {"custom_id": "first", "prompt": "Write a haiku about queues.\n", "max_tokens": 8}


def _env(home: Path, broker: str, database: str) -> dict[str, str]:
    """The worker's and submit's environment: this repository's code, a HOME of its own (every
    cache the CLI and torch keep lives under it), our broker and database."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPECBATCH_", "XDG_", "TORCHINDUCTOR_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", SPECBATCH_BROKER_URL=broker,
               SPECBATCH_DATABASE_URL=database, SPECBATCH_COMPILE="off")
    return env


def _submit(env: dict[str, str], work: Path) -> str:
    path = work / "prompts.jsonl"
    path.write_text(json.dumps(PROMPT) + "\n")
    out = subprocess.run([*SPECBATCH, "submit", str(path), "--no-cache", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"submit failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["id"]


def _first_claim(database: str, job_id: str) -> datetime | None:
    from sqlalchemy import func, select

    from specbatch.db import session_factory
    from specbatch.db.models import Request

    with session_factory(database, readonly=True).begin() as s:
        return s.scalar(select(func.min(Request.started_at)).where(Request.job_id == job_id))


def _finished(database: str, job_id: str) -> bool:
    from specbatch.db import session_factory
    from specbatch.jobs import store

    with session_factory(database, readonly=True).begin() as s:
        return store.job_summary(s, job_id)["status"] in ("completed", "completed_with_errors", "failed")


def _states(broker: str, database: str, queue: str) -> list[str]:
    from specbatch.config import Settings
    from specbatch.worker.monitor import queue_workers

    settings = Settings.from_env({"SPECBATCH_BROKER_URL": broker, "SPECBATCH_DATABASE_URL": database})
    views = queue_workers(settings, queue, timeout=0.5) or []
    return [f"{'consuming' if v.consuming else 'not consuming'}: {v.state or '-'}" for v in views]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker (a warm shutdown), SIGKILL its process group 30 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def one_start(mode: str, home: Path, work: Path, broker: str, database: str | None, timeout: float,
              name: str) -> dict[str, Any]:
    """Submit one request, start a worker, time its first claim; stop it once the job is done."""
    from specbatch.config import get_settings
    from specbatch.worker.queues import queue_name

    work.mkdir(parents=True, exist_ok=True)
    database = database or f"sqlite:///{work / 'specbatch.db'}"
    env = _env(home, broker, database)
    job_id = _submit(env, work)
    settings = get_settings()
    queue = queue_name(settings.default_target, [settings.default_draft])
    load_before = os.getloadavg()[0]
    log = (work / "worker.log").open("wb")
    t0 = datetime.now(timezone.utc)
    mono0 = time.monotonic()
    proc = subprocess.Popen([*SPECBATCH, "worker", "--compile", mode, "-n", f"{name}@%h", "--loglevel", "INFO"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[str, float] = {}
    claim: datetime | None = None
    load_at_claim = None
    try:
        while time.monotonic() - mono0 < timeout and proc.poll() is None:
            for state in _states(broker, database, queue):
                seen.setdefault(state, round(time.monotonic() - mono0, 1))
            if claim is None and (claim := _first_claim(database, job_id)) is not None:
                load_at_claim = os.getloadavg()[0]
            if claim is not None and _finished(database, job_id):
                break
            time.sleep(0.5)
        for state in _states(broker, database, queue):   # what it says once the first job is done
            seen.setdefault(state, round(time.monotonic() - mono0, 1))
    finally:
        _stop(proc)
        log.close()
    return {"mode": mode, "first_claim_s": None if claim is None else round((claim - t0).total_seconds(), 1),
            "states": seen, "load_before": load_before, "load_at_claim": load_at_claim,
            "exit": proc.returncode, "log": str(work / "worker.log"), "job": job_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", default="auto,on", help="modes, comma-separated (auto, on, off)")
    parser.add_argument("--rounds", type=int, default=1, help="cold + warm starts per mode")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/12", help="a Redis db of its own")
    parser.add_argument("--database-url", default=None,
                        help="e.g. postgresql+psycopg://postgres@127.0.0.1:5432/NAME (default: a fresh "
                             "SQLite file per start)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per start at most")
    parser.add_argument("--keep", action="store_true", help="keep the HOMEs and worker logs")
    parser.add_argument("--out", default=None, help="also write the results here as JSON")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="specbatch-worker-start-"))
    results = []
    try:
        for r in range(1, args.rounds + 1):
            for mode in args.compile.split(","):
                home = root / f"home-{mode}-{r}"
                home.mkdir()
                for cache in ("cold", "warm"):
                    res = one_start(mode, home, root / f"{mode}-{r}-{cache}", args.broker, args.database_url,
                                    args.timeout, f"start-{mode}-{r}-{cache}")
                    res.update(round=r, cache=cache)
                    results.append(res)
                    print(json.dumps(res), flush=True)
    finally:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| --compile | round | cache | first claim s | status: 'starting' at s | status: consuming at s, state "
          "| load before / at claim |")
    print("|---|---:|---|---:|---:|---|---|")
    for res in results:
        claim_load = "-" if res["load_at_claim"] is None else f"{res['load_at_claim']:.1f}"
        print(f"| {res['mode']} | {res['round']} | {res['cache']} | {res['first_claim_s']} | "
              f"{_first(res['states'], 'not consuming: starting')} | {_consuming(res['states'])} | "
              f"{res['load_before']:.1f} / {claim_load} |")


def _first(states: dict[str, float], prefix: str) -> str:
    times = [t for s, t in states.items() if s.startswith(prefix)]
    return f"{min(times)}" if times else "-"


def _consuming(states: dict[str, float]) -> str:
    """When status first showed it consuming, and what state it showed then (shortened)."""
    seen = sorted((t, s) for s, t in states.items() if s.startswith("consuming: "))
    if not seen:
        return "-"
    t, state = seen[0]
    state = state.removeprefix("consuming: ")
    return f"{t}: {state[:48]}{'...' if len(state) > 48 else ''}"


if __name__ == "__main__":
    main()
