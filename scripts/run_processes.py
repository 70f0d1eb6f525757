"""`specbatch run` of the default job in one process against several forked ones (`--processes`),
each run a new process of its own, interleaved round by round, outputs compared token for token:

    python scripts/run_processes.py --rounds 3                     # 1 against 2 processes
    python scripts/run_processes.py --rounds 2 --processes 1 2 4 --busy

Each run writes to a new SQLite file (no results cache). Printed per run: the job's own tokens/s
(generated tokens over its first start to its last result: no load), the command's seconds in
all (the load included) and the machine's load average; then each variant's mean against the
first's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def digest(url: str) -> str:
    from sqlalchemy import select

    from specbatch.db import session_factory
    from specbatch.db.models import Request, Result

    with session_factory(url, readonly=True).begin() as s:
        rows = s.execute(select(Request.custom_id, Result.sample_index, Result.token_ids)
                         .join(Request, Request.id == Result.request_id).order_by(Request.custom_id,
                                                                                   Result.sample_index)).all()
    return hashlib.sha256(json.dumps([list(r) for r in rows]).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--busy", action="store_true", help="a busy process beside it the whole time")
    a = ap.parse_args()
    exe = str(Path(sys.executable).parent / "specbatch")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    seen: dict[int, list[float]] = {p: [] for p in a.processes}
    digests = set()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for p in a.processes:
                    url = f"sqlite:///{tmp}/r{r}-p{p}.db"
                    env = {**os.environ, "SPECBATCH_DATABASE_URL": url, "SPECBATCH_PROCESSES": str(p)}
                    load0 = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    out = subprocess.run([exe, "run", a.file, "--no-cache", "--json"], env=env,
                                         capture_output=True, text=True)
                    seconds = time.perf_counter() - t0
                    if out.returncode != 0:
                        raise SystemExit(f"processes {p}: exit {out.returncode}\n{out.stderr[-2000:]}")
                    stats = json.loads(out.stdout)["stats"]
                    seen[p].append(stats["tokens_per_second"])
                    digests.add(digest(url))
                    print(f"round {r} processes {p}: {stats['tokens_per_second']:.1f} tok/s "
                          f"({stats['tokens_generated']} tokens in {stats['wall_clock_seconds']:.1f} s), "
                          f"{seconds:.1f} s in all, load {load0:.1f}-{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if busy is not None:
            busy.kill()
    base = sum(seen[a.processes[0]]) / len(seen[a.processes[0]])
    for p, v in seen.items():
        mean = sum(v) / len(v)
        print(f"processes {p}: mean {mean:.1f} tok/s, {mean / base:.2f}x processes {a.processes[0]}")
    print("outputs identical" if len(digests) == 1 else f"OUTPUTS DIFFER: {sorted(digests)}")


if __name__ == "__main__":
    main()
