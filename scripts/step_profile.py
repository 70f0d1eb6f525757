"""A job file through ``Engine.generate_many`` in one process: tokens/s, or where the time goes.

    PYTHONPATH=TREE python scripts/step_profile.py examples/job-mixed-48.jsonl --batch auto --threads 1
    PYTHONPATH=TREE python scripts/step_profile.py FILE --batch 32 --plain --profile   # buckets + top ops

Loads the default pair once (as ``specbatch bench --job`` does), decodes the file's first 2
requests untimed (a warm-up), then ``--repeats`` timed passes, printing one ``RESULT`` JSON line per
pass (new tokens, seconds, tokens/s, the 1-minute load average before and after, and a digest of
the outputs, so two trees' runs can be compared token for token). ``--phases``: each pass's time
split into the decoder's admissions (prompts cached: prefill) and its steps by the rows in them, a
``PHASES`` JSON line and a table (where a job's time goes by batch fullness: its tail of few rows
is bound by reading the weights, not by the GEMMs; scripts/forward_floor.py). ``--profile``: one more pass
under ``torch.profiler`` with bench/breakdown.py's buckets, and the operators of the cache and
element-wise buckets by self time with their input shapes. For the Python callers, run the timed
mode under py-spy (``py-spy record -r 50 -f raw -o prof.txt -- python scripts/step_profile.py ...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--batch", default="auto", help="auto or a fixed batch size")
    ap.add_argument("--plain", action="store_true", help="the target alone (no draft)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--phases", action="store_true", help="each pass's time by admissions and by step rows")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--reference", action="store_true",
                    help="compare the last pass's outputs with the target alone (HF generate, one prompt at a time)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from specbatch.bench import breakdown
    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine import Engine, EngineRequest, GenerationParams
    from specbatch.engine.loading import load_model
    from specbatch.jobs import intake

    settings = Settings.from_env()
    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "cache_dir": settings.cache_dir or None,
          "linears": settings.linears}
    target = load_model(settings.default_target, **kw)
    draft = load_model(settings.default_draft, **kw, loaded=[target])
    parsed = intake.parse_file(a.file, None, settings)
    jobs = job_requests(parsed, target)
    size: int | str = a.batch if a.batch == "auto" else int(a.batch)

    drafted = [0, 0]        # the last pass's drafted and accepted tokens

    def once(items: list[tuple[list[int], int]]) -> tuple[list[list[int]], float]:
        engine = Engine(target, [] if a.plain else [draft], batch_size=size)
        reqs = [EngineRequest(input_ids=x, params=GenerationParams(max_new_tokens=n)) for x, n in items]
        outs: list[list[int]] = [[] for _ in reqs]
        drafted[:] = [0, 0]
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, out in engine.generate_many(reqs):
                if isinstance(out, Exception):
                    raise RuntimeError(f"request {i}: {out}")
                outs[i] = list(out.token_ids)
                drafted[0] += out.stats.drafted_tokens
                drafted[1] += out.stats.accepted_tokens
        return outs, time.perf_counter() - t0

    once(jobs[:2])
    phases = _time_phases() if a.phases else None
    outs: list[list[int]] = []
    for r in range(a.repeats):
        load0 = os.getloadavg()[0]
        if phases is not None:
            phases.clear()
        outs, seconds = once(jobs)
        tokens = sum(len(o) for o in outs)
        digest = hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]
        print("RESULT " + json.dumps({"repeat": r, "tokens": tokens, "seconds": round(seconds, 2),
                                      "tok_s": round(tokens / seconds, 2), "load0": round(load0, 2),
                                      "drafted": drafted[0], "accepted": drafted[1],
                                      "acceptance": round(drafted[1] / max(1, drafted[0]), 3),
                                      "load1": round(os.getloadavg()[0], 2), "outputs": digest}), flush=True)
        if phases is not None:
            _print_phases(phases, seconds)
    if a.reference:
        _reference(target, jobs, outs)
    if a.profile:
        _profile(lambda: once(jobs), target, breakdown, a.top)


def _time_phases() -> dict[str, list[float]]:
    """From now on, every ``Decoder._admit`` (prompts cached) and ``Decoder._step`` adds its count
    and seconds to the returned dict: ``"admit"``, or ``"step N"`` for a step of N rows."""
    import specbatch.engine.decoder as decoder

    seen: dict[str, list[float]] = {}

    def timed(name: str, real: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            key = name if name == "admit" else f"step {len(self.rows)}"
            t0 = time.perf_counter()
            try:
                return real(self, *args, **kwargs)
            finally:
                entry = seen.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0
        return run

    decoder.Decoder._admit = timed("admit", decoder.Decoder._admit)   # type: ignore[method-assign]
    decoder.Decoder._step = timed("step", decoder.Decoder._step)      # type: ignore[method-assign]
    return seen


def _print_phases(seen: dict[str, list[float]], seconds: float) -> None:
    steps = sorted((int(k.split()[1]), n, s) for k, (n, s) in seen.items() if k != "admit")
    admit = seen.get("admit", [0, 0.0])
    print("PHASES " + json.dumps({"admit": [admit[0], round(admit[1], 3)],
                                  "steps": {rows: [n, round(s, 3)] for rows, n, s in steps},
                                  "seconds": round(seconds, 3)}), flush=True)
    print(f"  admissions (prefill): {admit[0]:4d} {admit[1]:7.2f}s {admit[1] / seconds:6.1%}")
    for rows, n, s in steps:
        print(f"  steps of {rows:3d} rows:   {n:4d} {s:7.2f}s {s / seconds:6.1%}  {s / n * 1e3:6.1f} ms a step")
    rest = seconds - admit[1] - sum(s for _, _, s in steps)
    print(f"  outside both:          {rest:7.2f}s {rest / seconds:6.1%}")


def _reference(target: Any, jobs: list[tuple[list[int], int]], outs: list[list[int]]) -> None:
    """Each output against the target's own greedy decoding, cut at EOS (as bench --job compares)."""
    from specbatch.bench.runners import HFRunner, cut_at_eos

    hf = HFRunner(target)
    eos = target.eos_token_ids
    differ = []
    for i, ((x, n), got) in enumerate(zip(jobs, outs)):
        ref = cut_at_eos(hf.batch([x], n)[0][0], eos)[:n]
        if cut_at_eos(got, eos)[:n] != ref:
            differ.append(i)
    print("REFERENCE " + json.dumps({"requests": len(jobs), "identical": len(jobs) - len(differ), "differ": differ}),
          flush=True)


def _profile(run: Any, target: Any, breakdown: Any, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    forwards = sum(e.count for e in prof.key_averages() if e.key == "aten::embedding")
    per_bucket: dict[str, list[tuple[float, int, str, str]]] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith(("aten::", "quantized::", "mkl::", "mkldnn::")):
            b = breakdown._bucket(e.key, list(e.input_shapes or []), target.vocab_size)
            per_bucket.setdefault(b, []).append((e.self_cpu_time_total / 1e6, e.count, e.key,
                                                 str(e.input_shapes)[:110]))
    seconds = {b: sum(x[0] for x in v) for b, v in per_bucket.items()}
    seconds["python_and_dispatch"] = max(0.0, wall - sum(seconds.values()))
    print(f"PROFILE wall {wall:.1f}s, {forwards} embedding calls (target + draft forwards)")
    for b in breakdown.BUCKETS:
        print(f"  {b:22s} {seconds.get(b, 0):7.2f}s {seconds.get(b, 0) / wall:5.1%}")
    for b in ("cache_management", "elementwise", "attention", "head_and_sampling"):
        by_op: dict[str, float] = {}
        for s, _, k, _ in per_bucket.get(b, []):
            by_op[k] = by_op.get(k, 0) + s
        print(f"{b}: by operator")
        for k, s in sorted(by_op.items(), key=lambda x: -x[1])[:top]:
            print(f"  {s:7.2f}s {k}")
        print(f"{b}: by operator and shapes")
        for s, n, k, shapes in sorted(per_bucket.get(b, []), reverse=True)[:top]:
            print(f"  {s:7.2f}s {n:6d}x {k} {shapes}")


if __name__ == "__main__":
    main()
