"""Per decode step of the default job: the process's CPU time over wall time x torch threads,
quiet, then beside a busy process, then quiet again (what engine/contention.py reads):

    PYTHONPATH=. python scripts/thread_use.py --threads 2

Prints, per pass, the job's seconds, its steps and the ratio over all steps and at the 10th, 50th
and 90th percentile of steps. Measured on a 2-core Zen 5: 0.96 / 1.00 / 1.03 quiet, 0.58 / 0.73 /
0.75 busy (docs/DESIGN.md, "Threads that follow the machine"). The threads stay fixed here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine import decoder as dec
    from specbatch.engine.loading import load_model
    from specbatch.jobs import intake

    settings = Settings.from_env()
    kw = {"device": "cpu", "dtype": "float32", "cache_dir": settings.cache_dir or None,
          "linears": settings.linears}
    target = load_model(settings.default_target, **kw)
    draft = load_model(settings.default_draft, **kw, loaded=[target])
    jobs = job_requests(intake.parse_file(a.file, None, settings), target)
    real = dec.Decoder._step
    samples: list[tuple[float, float]] = []

    def step(self: dec.Decoder) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        real(self)
        samples.append((time.perf_counter() - w0, time.process_time() - c0))

    dec.Decoder._step = step   # type: ignore[method-assign]
    for busy in (False, True, False):
        other = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        samples.clear()
        reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in jobs]
        t0 = time.perf_counter()
        dict(Engine(target, [draft]).generate_many(reqs))
        seconds = time.perf_counter() - t0
        if other is not None:
            other.kill()
        n = torch.get_num_threads()
        use = sorted(c / (w * n) for w, c in samples)
        overall = sum(c for _, c in samples) / (sum(w for w, _ in samples) * n)
        q = [use[int(p * (len(use) - 1))] for p in (0.1, 0.5, 0.9)]
        print(f"{'busy ' if busy else 'quiet'} threads {n}: job {seconds:.1f} s, {len(use)} steps, "
              f"use {overall:.2f} (p10 {q[0]:.2f}, p50 {q[1]:.2f}, p90 {q[2]:.2f})", flush=True)


if __name__ == "__main__":
    main()
