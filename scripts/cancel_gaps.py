"""The gaps between a worker's cancel checks while it decodes: what a cancel waits for once the
cancel watch has seen it (docs/DESIGN.md, "Cancelling"). In one run, for the same decode: main's
check (a pre-hook on the target model: before each target forward) and this branch's (a pre-hook on
every model's decoder layers, the drafts too: ``worker.interrupt.interruptible``).

Sampled rows (temperature > 0, some n = 2, logprobs, penalties) of varied lengths, more requests
than the batch holds so it refills as a worker's does; the default pair unless --target/--draft.

    PYTHONPATH=$PWD nice -n 5 /work/venv/bin/python scripts/cancel_gaps.py --batch-size 24 --requests 40
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from specbatch.config import get_settings
from specbatch.engine import Engine, EngineRequest, GenerationParams

PROMPTS: list[str] = []   # --prompts: a JSONL file's prompts, in turn


def requests(n: int, start: int = 0) -> list[EngineRequest]:
    out = []
    for i in range(start, start + n):
        prompt = PROMPTS[i % len(PROMPTS)] if PROMPTS else f"Tell a long story about a lighthouse keeper {i}."
        out.append(EngineRequest(prompt=prompt, params=GenerationParams(
            max_new_tokens=60 + i * 37 % 340, temperature=0.8, seed=i, n=2 if i % 3 == 0 else 1,
            logprobs=2 if i % 2 == 0 else None, presence_penalty=0.5 if i % 4 == 1 else 0.0,
            frequency_penalty=0.3 if i % 4 == 1 else 0.0)))
    return out


def summary(name: str, times: list[float], t_end: float) -> str:
    gaps = sorted(b - a for a, b in zip(times, [*times[1:], t_end]))
    # a cancel arriving at a uniformly random moment waits, on average, sum(gap^2) / (2 * sum(gap))
    mean_wait = sum(g * g for g in gaps) / (2 * sum(gaps))
    q = lambda f: gaps[min(len(gaps) - 1, int(f * len(gaps)))]  # noqa: E731
    return (f"{name:28s} checks {len(gaps):7d}  gap p50 {q(0.5) * 1e3:8.1f} ms  p99 {q(0.99) * 1e3:8.1f} ms  "
            f"max {gaps[-1] * 1e3:8.1f} ms  mean wait of a cancel {mean_wait * 1e3:8.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-int8")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--first", type=int, default=8, help="requests of the first claim (SPECBATCH_CHUNK_SIZE)")
    ap.add_argument("--prompts", default="", help="a JSONL file: its lines' prompts (e.g. examples/job-mixed-48.jsonl)")
    a = ap.parse_args()
    if a.prompts:
        PROMPTS.extend(json.loads(line)["prompt"] for line in open(a.prompts) if line.strip())
    engine = Engine.load(a.target, [a.draft], batch_size=a.batch_size, cache_dir=get_settings().cache_dir,
                         linears=get_settings().linears)
    target_forwards: list[float] = []   # main's checks
    layers: list[float] = []            # this branch's
    hooks = [engine.target.model.register_forward_pre_hook(lambda *_: target_forwards.append(time.perf_counter()))]
    for lm in (engine.target, *engine.drafts):
        for m in (m for lst in lm.model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst):
            hooks.append(m.register_forward_pre_hook(lambda *_: layers.append(time.perf_counter())))
    left = list(range(a.first, a.requests))

    def more(room: int) -> list[EngineRequest]:   # a worker's refill: claims more of its job
        take = left[:max(room, 8)]
        del left[:len(take)]
        return [r for i in take for r in requests(1, i)]

    print(f"load {os.getloadavg()}, torch threads {torch.get_num_threads()}", flush=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        n = sum(1 for _ in engine.generate_many(requests(a.first), more=more))
    t_end = time.perf_counter()
    for h in hooks:
        h.remove()
    print(f"{n} outputs in {t_end - t0:.1f} s; load {os.getloadavg()}")
    print(summary("target forwards (main)", target_forwards, t_end))
    print(summary("every layer, drafts too", layers, t_end))


if __name__ == "__main__":
    main()
