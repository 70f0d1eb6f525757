"""The default job decoded by two checkouts of specbatch, A B B A, one fresh process per run: tok/s
of each and whether their outputs are the same. For "N x faster than when the issue was filed"
measured in one session on one machine, not across hosts.

    git worktree add /tmp/then d92206c      # main when issue 31 was filed
    OMP_NUM_THREADS=2 python scripts/trees_job.py /tmp/then . --configs auto --threads 2 --rounds 2

``--temperature T``: every line sampled at T, line i seeded i (default 0: greedy, the job as filed);
``--fixed-gamma``: every line at gamma 4, not adapting.

The prompts are tokenized once, here, and handed to both (each decodes the same ids with its own
engine, ``specbatch.bench.job._ours``, which both versions have). Model loading is not timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from interleave import abba, child_result

CONFIGS = {"auto": ("auto", "auto"), "B32plain": (32, False), "B32spec": (32, True), "B8spec": (8, True),
           "B8plain": (8, False)}

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from specbatch.bench.job import JobConfig, _ours
import time
from specbatch.config import Settings
from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.loading import load_model
job = json.load(open(sys.argv[2]))
torch.set_num_threads(job["threads"])
settings = Settings()
kw = {"cache_dir": settings.cache_dir}
if "linears" in type(settings).model_fields:   # an older tree read SPECBATCH_LINEARS itself, or had no packed Linears
    kw["linears"] = settings.linears
target = load_model("smollm2-135m", **kw)
draft = load_model("smollm2-135m-int8", **kw)
_ours(target, draft, JobConfig("warm-up", "ours", 2, True), job["ids"][:2], [4, 4])
t = job["temperature"]   # sampled: line i seeded i
engine = Engine(target, [draft] if job["spec"] else [], batch_size=job["batch"])
def params(i, n):    # only what differs from the defaults: an old tree may lack the newer fields
    kw = {"max_new_tokens": n}
    if t:
        kw.update(temperature=t, seed=i)
    if job["fixed_gamma"]:
        kw["adaptive"] = False
    return GenerationParams(**kw)
reqs = [EngineRequest(input_ids=x, params=params(i, n)) for i, (x, n) in enumerate(zip(job["ids"], job["limits"]))]
got = [None] * len(reqs)
t0 = time.perf_counter()
for i, out in engine.generate_many(reqs):
    if isinstance(out, Exception):
        raise RuntimeError(f"prompt {i}: {out}")
    got[i] = out
seconds = time.perf_counter() - t0
outs = [list(o.token_ids) for o in got]
drafted = sum(o.stats.drafted_tokens for o in got)
accepted = sum(o.stats.accepted_tokens for o in got)
print("RESULT " + json.dumps({"tokens": sum(map(len, outs)), "seconds": seconds, "outs": outs,
                              "acceptance": accepted / drafted if drafted else 0.0}))
"""

def requests(file: str) -> tuple[list[list[int]], list[int]]:
    from specbatch.bench.job import job_requests
    from specbatch.config import Settings
    from specbatch.engine.loading import load_model
    from specbatch.jobs import intake

    s = Settings()
    target = load_model("smollm2-135m", cache_dir=s.cache_dir, linears=s.linears)
    ids, limits = zip(*job_requests(intake.parse_file(file, None, s), target))
    return list(ids), list(limits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs=2, help="two checkouts: A (e.g. the old one) and B")
    ap.add_argument("--file", default="examples/job-mixed-48.jsonl")
    ap.add_argument("--configs", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--fixed-gamma", action="store_true", help="every line adaptive=False (the engine's gamma 4)")
    a = ap.parse_args()
    ids, limits = requests(a.file)
    trees = [str(Path(t).resolve()) for t in a.trees]
    rates: dict[tuple[str, str], list[float]] = {}
    digests: dict[tuple[str, str], set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for name in a.configs.split(","):
                batch, spec = CONFIGS[name]
                spec_file = Path(tmp) / f"{name}.json"
                spec_file.write_text(json.dumps({"ids": ids, "limits": limits, "threads": a.threads,
                                                 "name": name, "batch": batch, "spec": spec,
                                                 "temperature": a.temperature, "fixed_gamma": a.fixed_gamma}))
                for tree in abba(rnd, trees):
                    r = child_result([sys.executable, "-c", CHILD, tree, str(spec_file)],
                                     {**os.environ, "PYTHONPATH": tree}, tree, cwd=tree)
                    rate = r["tokens"] / r["seconds"]
                    digest = hashlib.sha256(json.dumps(r["outs"]).encode()).hexdigest()[:12]
                    rates.setdefault((name, tree), []).append(rate)
                    digests.setdefault((name, tree), set()).add(digest)
                    print(f"round {rnd} {name:9s} {tree}: {rate:7.1f} tok/s ({r['tokens']} tokens, "
                          f"{r['seconds']:.1f} s) acceptance {r['acceptance']:.2f} outputs {digest} load {os.getloadavg()[0]:.1f}", flush=True)
    for name in a.configs.split(","):
        ra, rb = (sum(rates[(name, t)]) / len(rates[(name, t)]) for t in trees)
        same = digests[(name, trees[0])] == digests[(name, trees[1])] and len(digests[(name, trees[0])]) == 1
        print(f"{name}: A {ra:.1f} tok/s, B {rb:.1f} tok/s, B / A {rb / ra:.2f}x, same outputs: {same}")


if __name__ == "__main__":
    main()
