"""The static-cache backend (engine/static_cache.py) against BatchCache on the default target:
per-step time, a one-row verify, and a whole job (docs/COMPILE.md, "The static-cache backend").

    PYTHONPATH=TREE nice -n 5 python scripts/static_backend_bench.py --cache-dir /tmp/static-bench --json out.json
    python scripts/static_backend_bench.py --device cuda --dtype bfloat16 --target DIR --no-lock --skip job ...

On CPU one torch thread; on CUDA the classes are CUDA graphs (``reduce-overhead``) and every
interval waits for the device (``engine.clock``), so the same table reads a GPU
(scripts/gpu_check.sh runs it there on the benchmark pair's shapes, docs/bench/report-gpu.md).

One process, 1 torch thread. First (no lock) the static classes are compiled and warmed up:
one-token steps of every slot count in ``--batch-sizes`` and one-row verifies of ``--positions``
(``compile.static.prepare_static``, which also times each against the eager static backend).
Then, holding ``/work/wt/measure.lock`` (the lock ``flock`` takes; other sessions time under it
too) and once the 1-minute load average is at most ``--max-load``:

- ``steps``: ms per one-token step at B rows over ``--prompt-len`` cached tokens of the job's
  text, BatchCache eager, StaticBatchCache eager, StaticBatchCache through its compiled class;
  ``--steps`` steps a round, rolled back after (the cache length stays), the variants in turn,
  median over ``--rounds``; and whether every step's argmax agrees with BatchCache's.
- ``verify``: one row scoring k positions (a verify of k - 1 drafts), the same three variants.
- ``job``: ``--job`` decoded plain (the target alone) at ``--job-batch`` rows through ``Engine``:
  BatchCache (today's default), the static backend eagerly, and the static backend with the
  one-token classes of up to ``--job-slots`` slots compiled; tokens/s per pass, passes
  interleaved, the outputs compared token for token with the BatchCache pass.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from static_compile_probe import job_rows  # the job's text as equal-length rows (scripts/ is on the path)

from specbatch.engine import clock


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


@contextmanager
def measuring(max_load: float, wait_s: float) -> Iterator[dict[str, float]]:
    """The measure lock held and the load average at most ``max_load`` (waited for up to
    ``wait_s``); yields the load seen at the start, filled with the load at the end."""
    t0 = time.time()
    with open("/work/wt/measure.lock", "a") as f:
        while True:   # (the lock is not held while waiting for the load: others may time meanwhile)
            while os.getloadavg()[0] > max_load and time.time() - t0 < wait_s:
                time.sleep(10)
            fcntl.flock(f, fcntl.LOCK_EX)
            if os.getloadavg()[0] <= max_load or time.time() - t0 >= wait_s:
                break
            fcntl.flock(f, fcntl.LOCK_UN)
        seen = {"load_start": os.getloadavg()[0], "waited_s": round(time.time() - t0)}
        try:
            yield seen
        finally:
            seen["load_end"] = os.getloadavg()[0]
            fcntl.flock(f, fcntl.LOCK_UN)


def timed_steps(backends: dict[str, Any], feed: list[list[int]], steps: int, rounds: int, device: str = "cpu"
                ) -> tuple[dict[str, float], dict[str, bool]]:
    """Median ms per call of ``forward(feed)`` per backend over ``rounds`` rounds of ``steps``
    calls (each round rolled back), the backends in turn; and per backend whether every call's
    argmax equalled the first backend's."""
    width = len(feed[0])
    ms: dict[str, list[float]] = {name: [] for name in backends}
    argmax: dict[str, list[torch.Tensor]] = {name: [] for name in backends}
    for r in range(rounds):
        for name, b in backends.items():
            t0 = clock.now(device)
            for _ in range(steps):
                logits = b.forward(feed, width)
                if r == 0:
                    argmax[name].append(logits.argmax(-1))
            ms[name].append((clock.now(device) - t0) * 1e3 / steps)
            b.drop_tail([steps * width] * len(feed))
    first = next(iter(backends))
    same = {name: all(torch.equal(a, c) for a, c in zip(argmax[first], argmax[name])) for name in backends}
    return {name: statistics.median(v) for name, v in ms.items()}, same


def primed(make: Callable[[], Any], rows: list[list[int]]) -> Any:
    b = make()
    b.forward(rows, 1)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--positions", type=ints, default=[1, 2, 3, 4, 5])
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--job", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--job-batch", type=int, default=32)
    ap.add_argument("--job-slots", type=int, default=16, help="job: compiled one-token classes up to this many slots")
    ap.add_argument("--job-rounds", type=int, default=2)
    ap.add_argument("--target", help="the target (default: the default target)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-lock", action="store_true", help="time at once, without the measure lock (a machine of its own)")
    ap.add_argument("--max-load", type=float, default=2.5)
    ap.add_argument("--wait", type=float, default=1800, help="seconds to wait for the load to drop")
    ap.add_argument("--cache-dir", required=True, help="records and inductor's caches (compile.inductor.use_cache_dir)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: steps, verify, job")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)

    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine.cache import BatchCache
    from specbatch.engine.compile.inductor import use_cache_dir
    from specbatch.engine.compile.static import prepare_static
    from specbatch.engine.loading import load_model
    from specbatch.engine.static_cache import StaticBatchCache, slots_for
    from specbatch.jobs import intake

    skip = set(a.skip.split(","))
    use_cache_dir(a.cache_dir)
    settings = Settings.from_env()
    target = load_model(a.target or settings.default_target, device=a.device, dtype=a.dtype,
                        cache_dir=settings.cache_dir or None, linears=settings.linears)
    result: dict[str, Any] = {"torch": torch.__version__, "args": vars(a)}
    classes = list(dict.fromkeys([(slots_for(b), 1) for b in a.batch_sizes]
                                 + [(1, k) for k in a.positions if "verify" not in skip]))
    t0 = time.perf_counter()
    graphs, report = prepare_static(target, classes, a.cache_dir, lambda n, g: StaticBatchCache(target, n, g),
                                    keep_all=True,
                                    progress=lambda s: print(f"compiling: {s} ({time.perf_counter() - t0:.0f} s)", flush=True))
    assert graphs is not None, report.to_dict()
    result["compile"] = report.to_dict()
    print("COMPILE " + json.dumps(result["compile"]), flush=True)
    all_classes = set(graphs.classes)

    timing = nullcontext({"load_start": os.getloadavg()[0], "waited_s": 0}) if a.no_lock else measuring(a.max_load, a.wait)
    with torch.inference_mode(), timing as load:
        result["load"] = load
        print(f"measuring at load {load['load_start']:.2f} (waited {load['waited_s']} s)", flush=True)
        if "steps" not in skip:
            result["steps"] = []
            for b in a.batch_sizes:
                rows = job_rows(target.tokenizer, b, a.prompt_len).tolist()
                backends = {"batch": primed(lambda: BatchCache(target, b), rows),       # noqa: B023
                            "static": primed(lambda: StaticBatchCache(target, b), rows),  # noqa: B023
                            "compiled": primed(lambda: StaticBatchCache(target, b, graphs), rows)}  # noqa: B023
                ms, same = timed_steps(backends, [[rows[i][-1]] for i in range(b)], a.steps, a.rounds, a.device)
                row = {"B": b, "ms": ms, "argmax_same": same}
                result["steps"].append(row)
                print("STEP " + json.dumps(row), flush=True)
        if "verify" not in skip:
            result["verify"] = []
            rows = job_rows(target.tokenizer, 1, a.prompt_len + max(a.positions)).tolist()
            prompt, fed = [rows[0][: a.prompt_len]], rows[0][a.prompt_len:]
            backends = {"batch": primed(lambda: BatchCache(target, 1), prompt),
                        "static": primed(lambda: StaticBatchCache(target, 1), prompt),
                        "compiled": primed(lambda: StaticBatchCache(target, 1, graphs), prompt)}
            for k in a.positions:
                ms, same = timed_steps(backends, [fed[:k]], 1, a.rounds * a.steps, a.device)
                row = {"k": k, "ms": ms, "argmax_same": same}
                result["verify"].append(row)
                print("VERIFY " + json.dumps(row), flush=True)
        if "job" not in skip:
            jobs = job_requests(intake.parse_file(a.job, None, settings), target)
            small = {(s, 1) for s in (1 << i for i in range(a.job_slots.bit_length())) if s <= a.job_slots}
            variants = {"batch": (False, None), "static": (True, None), "compiled": (True, graphs)}
            passes: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
            outputs: dict[str, list[list[int]]] = {}
            for r in range(a.job_rounds):
                for name, (static, g) in variants.items():
                    graphs.classes = small & all_classes
                    engine = Engine(target, [], batch_size=a.job_batch, static_cache=static)
                    engine.static_graphs = g
                    reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in jobs]
                    outs: list[list[int]] = [[] for _ in reqs]
                    calls = graphs.calls
                    l0, t1 = os.getloadavg()[0], time.perf_counter()
                    for i, out in engine.generate_many(reqs):
                        assert not isinstance(out, Exception), out
                        outs[i] = list(out.token_ids)
                    seconds = time.perf_counter() - t1
                    tokens = sum(len(o) for o in outs)
                    outputs.setdefault(name, outs)
                    row = {"variant": name, "round": r, "tokens": tokens, "seconds": round(seconds, 2),
                           "tok_s": round(tokens / seconds, 2), "load0": round(l0, 2),
                           "load1": round(os.getloadavg()[0], 2), "compiled_calls": graphs.calls - calls,
                           "misses": graphs.misses,
                           "identical_to_batch": outs == outputs["batch"],
                           "requests_differing": [i for i, (x, y) in enumerate(zip(outs, outputs["batch"])) if x != y]}
                    passes[name].append(row)
                    print("JOB " + json.dumps(row), flush=True)
            result["job"] = passes
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    print("DONE " + json.dumps({"load": result["load"]}), flush=True)


if __name__ == "__main__":
    main()
