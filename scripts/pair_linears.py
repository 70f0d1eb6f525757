"""A known target (and draft) decoded with its Linears over its GGUF's blocks (``SPECBATCH_LINEARS=
auto``) against one packed float32 kernel, each run a fresh process, A B B A: tok/s (loading not
timed) and whether the outputs are the same.

    OMP_NUM_THREADS=2 python scripts/pair_linears.py --target qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --prompts 4 --max-new-tokens 64 --batch 1 --rounds 2 --threads 2

The prompts are the first ``--prompts`` of specbatch/bench/prompts/code.jsonl with the target's chat
template, greedy, ``--batch`` rows at a time. The baseline kernel is ``--against`` (default: the one
``auto`` takes for weights of no block form on this CPU: engine/packed.py). The two orders of sums
differ, so outputs may differ at near-ties; how many are identical is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from interleave import abba, child_result

CHILD = r"""
import json, sys, time, torch
from specbatch.config import Settings
from specbatch.engine import Engine, EngineRequest, GenerationParams
from specbatch.engine.loading import load_model
from specbatch.engine.packed import PackedLinear
job = json.loads(sys.argv[1])
torch.set_num_threads(job["threads"])
s = Settings()
t0 = time.perf_counter()
target = load_model(job["target"], cache_dir=s.cache_dir, linears=s.linears)
drafts = [load_model(job["draft"], cache_dir=s.cache_dir, linears=s.linears, loaded=[target])] if job["draft"] else []
load = time.perf_counter() - t0
blocks = sum(1 for m in target.model.modules() if isinstance(m, PackedLinear) and m.blocks())
engine = Engine(target, drafts, batch_size=job["batch"])
prompts = [json.loads(line)["prompt"] for line in open(job["file"])][:job["prompts"]]
params = GenerationParams(max_new_tokens=job["max_new_tokens"])
engine.generate(prompt=prompts[0], params=GenerationParams(max_new_tokens=4))     # warm-up
t0 = time.perf_counter()
got = dict(engine.generate_many([EngineRequest(prompt=p, params=params) for p in prompts]))
seconds = time.perf_counter() - t0
outs = [list(got[i].token_ids) for i in range(len(prompts))]
print("RESULT " + json.dumps({"tokens": sum(map(len, outs)), "seconds": seconds, "outs": outs, "load": load,
                              "blocks": blocks}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", default="")
    a = ap.parse_args()
    if not a.against:
        from specbatch.engine.packed import kernel

        k = kernel("auto")
        a.against = k.name if k is not None else "mkl"
    job = {"target": a.target, "draft": a.draft, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
           "batch": a.batch, "threads": a.threads,
           "file": str(Path(__file__).resolve().parents[1] / "specbatch/bench/prompts/code.jsonl")}
    seen: dict[str, list[float]] = {"auto": [], a.against: []}
    outs: dict[str, list[list[int]]] = {}
    for r in range(a.rounds):
        for linears in abba(r, ["auto", a.against]):
            got = child_result([sys.executable, "-c", CHILD, json.dumps(job)],
                               {**os.environ, "SPECBATCH_LINEARS": linears}, linears)
            rate = float(got["tokens"]) / float(got["seconds"])
            seen[linears].append(rate)
            outs[linears] = got["outs"]
            print(f"round {r} {linears:7s} {rate:6.2f} tok/s ({got['tokens']} tokens, {got['seconds']:.1f} s) "
                  f"load {got['load']:.1f} s, {got['blocks']} Linears on blocks, "
                  f"load avg {os.getloadavg()[0]:.1f}", flush=True)
    mean = {k: sum(v) / len(v) for k, v in seen.items()}
    same = sum(x == y for x, y in zip(outs["auto"], outs[a.against]))
    print(f"blocks {mean['auto']:.2f} tok/s, {a.against} {mean[a.against]:.2f} tok/s: "
          f"{mean['auto'] / mean[a.against]:.2f}x; identical outputs {same}/{len(outs['auto'])}")


if __name__ == "__main__":
    t = time.time()
    main()
    print(f"({time.time() - t:.0f} s)")
