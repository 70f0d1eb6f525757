"""`specbatch run` of the default job under several settings, each run a new process of its own,
interleaved round by round (A B B A), outputs compared token for token:

    python scripts/run_variants.py SPECBATCH_PROCESSES=2 --rounds 3           # the default vs 2 processes
    python scripts/run_variants.py SPECBATCH_PROCESSES=2 SPECBATCH_LANES=2 --busy

A variant is one or more settings (``A=1,B=2``); the default settings always run first and are the
baseline. Each run writes to a new SQLite file (no results cache). Printed per run: the job's own
tokens/s (generated tokens from its first start to its last result: no load), the command's
seconds in all (the load included) and the machine's load average; then each variant's mean
against the default's. ``--busy``: a ``while True: pass`` process beside it the whole time.
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

from interleave import abba


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
    ap.add_argument("variants", nargs="+", help="settings, e.g. SPECBATCH_PROCESSES=2 or A=1,B=2")
    ap.add_argument("--busy", action="store_true", help="a busy process beside it the whole time")
    a = ap.parse_args()
    exe = str(Path(sys.executable).parent / "specbatch")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    variants = {"default": {}} | {v: dict(kv.split("=", 1) for kv in v.split(",")) for v in a.variants}
    names = list(variants)
    seen: dict[str, list[float]] = {v: [] for v in variants}
    digests = set()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for name in abba(r, names):
                    settings, k = variants[name], names.index(name)
                    url = f"sqlite:///{tmp}/r{r}-v{k}.db"
                    env = {**os.environ, **settings, "SPECBATCH_DATABASE_URL": url}
                    load0 = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    out = subprocess.run([exe, "run", a.file, "--no-cache", "--json"], env=env,
                                         capture_output=True, text=True)
                    seconds = time.perf_counter() - t0
                    if out.returncode != 0:
                        raise SystemExit(f"{name}: exit {out.returncode}\n{out.stderr[-2000:]}")
                    stats = json.loads(out.stdout)["stats"]
                    seen[name].append(stats["tokens_per_second"])
                    digests.add(digest(url))
                    print(f"round {r} {name}: {stats['tokens_per_second']:.1f} tok/s "
                          f"({stats['tokens_generated']} tokens in {stats['wall_clock_seconds']:.1f} s), "
                          f"{seconds:.1f} s in all, load {load0:.1f}-{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if busy is not None:
            busy.kill()
    base = sum(seen["default"]) / len(seen["default"])
    for name, v in seen.items():
        mean = sum(v) / len(v)
        print(f"{name}: mean {mean:.1f} tok/s, {mean / base:.2f}x the default")
    print("outputs identical" if len(digests) == 1 else f"OUTPUTS DIFFER: {sorted(digests)}")


if __name__ == "__main__":
    main()
