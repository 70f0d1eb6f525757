"""Greedy outputs of two code trees on one prompt file, compared by custom_id (a refactor's check).

    python scripts/compare_outputs.py                      # d4e52c9 vs this worktree
    python scripts/compare_outputs.py --base main -- --batch-size 1 --ngram
    python scripts/compare_outputs.py --base 8ad66d1 --rounds 2 --prompts examples/job-mixed-48.jsonl

The base tree is ``git archive BASE`` unpacked in a temporary directory; the other is this
worktree as it is (uncommitted changes included). Each runs ``specbatch run PROMPTS --json
[RUN_OPTIONS]`` in its own process with SPECBATCH_COMPILE=off and its own SQLite database (so
neither sees the other's results cache), then ``specbatch export JOB -o FILE`` (JSONL); the two
exports are compared line by line on custom_id: status code, finish reason, text and token
counts. ``--rounds N`` runs the two trees N times each, alternating (base, worktree, worktree,
base, ...) so drift on a shared machine hits both alike, and prints each run's job throughput
(the job's ``tokens_per_second``: completion tokens over the span from its first request's start
to its last one's end, model loading excluded) and the ratio of the medians. Model files are read from the usual SPECBATCH_CACHE_DIR (dequantized weights are the same
bytes for both). Prints one line per tree and the verdict; exit status 0 when every line is
identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLI = "from specbatch.cli.main import main; main()"


def specbatch(tree: Path, env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", CLI, *args], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode not in (0, 3):      # 3: completed with some requests failed (compared too)
        sys.exit(f"{tree}: specbatch {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def run_tree(name: str, tree: Path, work: Path, prompts: Path, options: list[str], tps: list[float]
             ) -> dict[str, dict[str, Any]]:
    db = work / f"{name}-{len(tps)}.db"     # a fresh database per run: no results cache between them
    env = {**os.environ, "PYTHONPATH": str(tree), "SPECBATCH_COMPILE": "off",
           "SPECBATCH_DATABASE_URL": f"sqlite:///{db}"}
    t0 = time.perf_counter()
    stdout = specbatch(tree, env, "run", str(prompts), "--json", *options)
    summary = json.loads(stdout[stdout.index("{"):])
    tps.append(float((summary.get("stats") or {}).get("tokens_per_second") or 0.0))
    export = work / f"{name}.jsonl"
    specbatch(tree, env, "export", summary["id"], "-o", str(export))
    lines = [json.loads(x) for x in export.read_text().splitlines() if x.strip()]
    print(f"{name}: {tree} job {summary['id']} {summary['status']}, {len(lines)} lines, "
          f"{time.perf_counter() - t0:.0f}s, {tps[-1]:.1f} tok/s")
    return {x["custom_id"]: _essentials(x) for x in lines}


def _essentials(line: dict[str, Any]) -> dict[str, Any]:
    response = line.get("response") or {}
    body = response.get("body") or {}
    choice = (body.get("choices") or [{}])[0]
    text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
    usage = body.get("usage") or {}
    return {"status_code": response.get("status_code"), "finish_reason": choice.get("finish_reason"),
            "text": text, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "error": line.get("error")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="d4e52c9", help="the commit to compare this worktree against")
    ap.add_argument("--prompts", default=str(REPO / "examples" / "prompts.jsonl"))
    ap.add_argument("--rounds", type=int, default=1, help="runs of each tree, alternating (throughput)")
    ap.add_argument("run_options", nargs="*", help="after --: options for both `specbatch run`s")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="specbatch-compare-") as tmp:
        work, base = Path(tmp), Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        print(f"options: {' '.join(args.run_options) or '(none)'}; prompts: {args.prompts}")
        prompts, speed = Path(args.prompts).resolve(), {"base": [], "worktree": []}
        before: dict[str, dict[str, Any]] = {}
        after: dict[str, dict[str, Any]] = {}
        for r in range(args.rounds):
            order = [("base", base), ("worktree", REPO)][:: 1 if r % 2 == 0 else -1]
            for name, tree in order:
                out = run_tree(name if name == "worktree" else f"base-{args.base}", tree, work, prompts,
                               args.run_options, speed[name])
                before, after = (out, after) if name == "base" else (before, out)
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for k in differ:
        print(f"  {k}: before {before.get(k)}\n  {' ' * len(k)}  after  {after.get(k)}")
    tokens = sum(v["completion_tokens"] or 0 for v in after.values())
    print(f"{len(before.keys() & after.keys()) - len(set(differ) & before.keys() & after.keys())}"
          f"/{len(before.keys() | after.keys())} lines identical (text, finish reason, token counts; "
          f"{tokens} completion tokens after)" + ("" if not differ else f"; {len(differ)} differ"))
    if args.rounds > 1:
        b, a = statistics.median(speed["base"]), statistics.median(speed["worktree"])
        print(f"throughput (median of {args.rounds}): base {b:.1f} tok/s, worktree {a:.1f} tok/s, "
              f"ratio {a / b if b else float('nan'):.2f}x")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
