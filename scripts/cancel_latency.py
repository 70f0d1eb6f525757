"""How long ``specbatch cancel`` takes to reach the rows a worker is generating (docs/CONTRACTS.md).

A real redis-server, a real ``specbatch worker`` (the default pair unless --target/--draft), a
SQLite file. Each round submits a job of sampled rows (temperature > 0, some n = 2, logprobs,
penalties; lengths vary, so rows finish and the batch refills while it decodes), waits until the worker decodes them, then runs ``specbatch cancel JOB`` and measures
cancel requested -> no row of the job running any more. ``--spy`` samples the pool child with
``py-spy dump`` meanwhile and prints what it was doing.

    PYTHONPATH=$PWD nice -n 5 /work/venv/bin/python scripts/cancel_latency.py --rounds 4 --batch-size 24
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLI = [sys.executable, "-c", "from specbatch.cli.main import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rows(n: int, round_: int) -> list[dict]:
    out = []
    for i in range(n):
        row: dict = {"custom_id": f"r{round_}-{i}", "prompt": f"Tell a long story about a lighthouse keeper {i}.",
                     "max_tokens": 60 + i * 37 % 340, "temperature": 0.8, "seed": i}
        if i % 3 == 0:
            row["n"] = 2
        if i % 2 == 0:
            row["logprobs"] = 2
        if i % 4 == 1:
            row["presence_penalty"] = 0.5
            row["frequency_penalty"] = 0.3
        out.append(row)
    return out


def marked(db: str, job: str) -> bool:
    """Whether ``cancel`` has marked the job (what the worker's cancel watch looks for)."""
    import sqlite3

    with sqlite3.connect(db) as c:
        return c.execute("select status from jobs where id = ?", (job,)).fetchone()[0] in ("cancelling", "cancelled")


def running(db: str, job: str) -> int:
    import sqlite3

    with sqlite3.connect(db) as c:
        return int(c.execute("select count(*) from requests where job_id = ? and status = 'running'",
                             (job,)).fetchone()[0])


def pool_child(pid: int) -> int | None:
    """The worker's descendant that used the most CPU: the pool child decoding."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,cputimes="], capture_output=True, text=True).stdout
    procs = {int(p): (int(pp), int(c)) for p, pp, c in (ln.split() for ln in out.splitlines())}
    kin, grew = {pid}, True
    while grew:
        more = {p for p, (pp, _) in procs.items() if pp in kin} - kin
        kin |= more
        grew = bool(more)
    kin.discard(pid)
    return max(kin, key=lambda p: procs[p][1]) if kin else None


def spy(pid: int, until: threading.Event, log: list[tuple[float, str]]) -> None:
    while not until.is_set():
        t = time.time()
        dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(pid)],
                              capture_output=True, text=True)
        log.append((t, dump.stdout + dump.stderr))
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch-size", default="24")
    ap.add_argument("--target", default="")
    ap.add_argument("--draft", default="")
    ap.add_argument("--spy", action="store_true")
    ap.add_argument("--decode-seconds", default="1,2,3,5,8",
                    help="decode this long before cancelling (round i: the i-th, cycling): the phase matters, "
                         "a cancel during refill's admissions waits longest")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cancel-latency-"))
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, cwd=tmp)
    db = tmp / "sb.db"
    env = {**os.environ, "SPECBATCH_DATABASE_URL": f"sqlite:///{db}", "SPECBATCH_BROKER_URL": f"redis://127.0.0.1:{port}/0",
           "SPECBATCH_BATCH_SIZE": a.batch_size, "PYTHONUNBUFFERED": "1", "SPECBATCH_CACHE_DIR": str(tmp / "cache")}
    env.pop("SPECBATCH_CACHE_DIR")      # the user's: dequantized weights, compiled graphs
    pair = [*(["--target", a.target] if a.target else []), *(["--draft", a.draft] if a.draft else [])]
    log = open(tmp / "worker.log", "w")
    worker = subprocess.Popen([*CLI, "worker", *pair, "-n", "lat@%h"], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        for r in range(a.rounds):
            f = tmp / f"job{r}.jsonl"
            f.write_text("".join(json.dumps(x) + "\n" for x in rows(a.requests, r)))
            said = subprocess.run([*CLI, "submit", str(f), *pair, "--json"], env=env, capture_output=True,
                                  text=True, check=True).stdout
            job = json.loads(said).get("job_id") or json.loads(said)["id"]
            t0 = time.time()
            while running(str(db), job) == 0:
                if time.time() - t0 > 300:
                    raise SystemExit(f"job {job}: no row running after 300 s\n{(tmp / 'worker.log').read_text()[-3000:]}")
                time.sleep(0.05)
            waits = [float(x) for x in a.decode_seconds.split(",")]
            time.sleep(waits[r % len(waits)])
            child = pool_child(worker.pid)
            stop, dumps = threading.Event(), []
            th = threading.Thread(target=spy, args=(child, stop, dumps)) if a.spy and child else None
            if th:
                th.start()
            load = os.getloadavg()[0]
            n_before = running(str(db), job)
            t_cancel = time.time()
            cancel = subprocess.Popen([*CLI, "cancel", job], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            t_marked = None
            while running(str(db), job) and time.time() - t_cancel < 60:
                if t_marked is None and marked(str(db), job):
                    t_marked = time.time()
                time.sleep(0.02)
            t_dropped = time.time()
            t_marked = t_marked or t_dropped
            out, _ = cancel.communicate()
            stop.set()
            if th:
                th.join()
            print(f"round {r}: decoded {waits[r % len(waits)]:.0f} s; job {job} load {load:.2f} running {n_before}: `cancel` started -> job marked "
                  f"{t_marked - t_cancel:.2f} s, marked -> rows dropped {t_dropped - t_marked:.2f} s; "
                  f"cancel said: {out.strip()}", flush=True)
            (tmp / f"dumps{r}.txt").write_text("".join(f"=== +{t - t_marked:.2f}s\n{d}" for t, d in dumps))
            for t, d in dumps:   # the decoding thread's innermost specbatch frames
                main_thread = d.split("Thread ")[1] if "Thread " in d else d
                frames = [ln.strip().split(" (")[0] for ln in main_thread.splitlines() if "specbatch/" in ln]
                print(f"  {t - t_marked:+5.2f}s after marked: " + " <- ".join(frames[:5]))
            time.sleep(1)
    finally:
        os.killpg(worker.pid, 15)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
        redis.terminate()
        print(f"logs: {tmp}")


if __name__ == "__main__":
    main()
