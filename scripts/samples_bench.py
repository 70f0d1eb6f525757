"""Measure ``n`` samples from one prefill against the same prompt on n separate lines, on the
default pair, interleaved on one engine (each round: both ways in turn, the order alternating):

  n=N        one request with n = N (the N rows fork from one prefill of the prompt)
  N lines    N requests of the same prompt (each row prefills it)

Both at batch size N, sampled (temperature 0.8); line i is seeded as sample i is
(``sample_seed``), so both ways draw the same samples. Prints per way: target prefill tokens
(tokens fed in forwards that cached a prompt), prefill seconds (those forwards' time, the fresh
batch's first step included), decode tokens/s (new tokens / wall time), and the ratios. Usage:

    python scripts/samples_bench.py [--n 8] [--rounds 2] [--max-new-tokens 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from specbatch.config import Settings
from specbatch.engine import Engine, GenerationParams
from specbatch.engine.cache import BatchCache
from specbatch.engine.engine import EngineRequest
from specbatch.engine.loading import load_model
from specbatch.engine.sampling import sample_seed

PROMPT = ("Summarize the following notes in three sentences.\n\n" + " ".join(
    f"Note {i}: the queue worker claimed a chunk of requests, decoded them in one batch with a small "
    "draft model proposing tokens and the target verifying them, then wrote every result with its "
    "acceptance statistics to the database before claiming the next chunk." for i in range(3)))
PREFILL_FEED = 16     # a forward feeding a row more than this caches a prompt (a step feeds <= 1 + gamma)


class Meter:
    """Target forwards, split into prefills (a long feed) and steps: tokens fed and seconds."""

    def __init__(self, target_name: str) -> None:
        self.name = target_name
        self.totals: dict[str, float] = defaultdict(float)
        self._forward = BatchCache.forward
        meter = self

        def forward(cache, feeds, logits_to_keep, parents=None, *, hidden=False):  # noqa: ANN001
            t0 = time.perf_counter()
            out = meter._forward(cache, feeds, logits_to_keep, parents, hidden=hidden)
            if cache.model.name == meter.name and max(len(f) for f in feeds) > PREFILL_FEED:
                meter.totals["prefill_seconds"] += time.perf_counter() - t0
                meter.totals["prefill_tokens"] += sum(len(f) for f in feeds)
            return out

        BatchCache.forward = forward  # type: ignore[method-assign]

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-int8")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    linears = Settings().linears
    target, draft = load_model(a.target, linears=linears), load_model(a.draft, linears=linears)
    engine = Engine(target, [draft], batch_size=a.n)
    meter = Meter(target.name)
    prompt_tokens = len(engine.encode(PROMPT))
    base = dict(max_new_tokens=a.max_new_tokens, temperature=0.8, gamma=3, adaptive=False)

    def jobs(seed: int) -> dict[str, list[EngineRequest]]:
        return {f"n={a.n}": [EngineRequest(prompt=PROMPT, params=GenerationParams(seed=seed, n=a.n, **base))],
                f"{a.n} lines": [EngineRequest(prompt=PROMPT, params=GenerationParams(seed=sample_seed(seed, i), **base))
                                 for i in range(a.n)]}

    engine.generate(prompt="Warm up.", params=GenerationParams(max_new_tokens=4))     # first-call costs
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    texts: dict[str, list[list[int]]] = {}
    for r in range(a.rounds):
        order = list(jobs(r).items())
        for name, reqs in order if r % 2 == 0 else order[::-1]:
            meter.take()
            # a fresh memory budget per run: the other way's run grows the process's memory, and a
            # budget calibrated on it would admit fewer rows at once (splitting the n=N group)
            engine.memory = None
            t0 = time.perf_counter()
            outs = [o for _, out in engine.generate_many(reqs, batch_size=a.n) for o in out.samples]
            wall = time.perf_counter() - t0
            m = meter.take()
            t = totals[name]
            t["wall"] += wall
            t["tokens"] += sum(len(o.token_ids) for o in outs)
            t["prefill_tokens"] += m.get("prefill_tokens", 0)
            t["prefill_seconds"] += m.get("prefill_seconds", 0)
            if r == 0:
                texts[name] = sorted(o.token_ids for o in outs)
            print(f"  round {r} {name}: {wall:.2f} s, prefill {m.get('prefill_seconds', 0):.2f} s", flush=True)
    print(f"prompt {prompt_tokens} tokens, n={a.n}, {a.max_new_tokens} new tokens, {a.rounds} rounds, "
          f"{a.threads} threads, target {a.target}, draft {a.draft}")
    for name, t in totals.items():
        print(f"  {name:>9}: prefill {t['prefill_tokens'] / a.rounds:7.0f} tokens {t['prefill_seconds'] / a.rounds:6.2f} s"
              f" | {t['tokens'] / t['wall']:6.1f} tok/s ({t['wall'] / a.rounds:.2f} s a round)")
    one, lines = totals[f"n={a.n}"], totals[f"{a.n} lines"]
    print(f"  ratios (lines / n): prefill tokens {lines['prefill_tokens'] / max(one['prefill_tokens'], 1):.2f}x, "
          f"prefill seconds {lines['prefill_seconds'] / max(one['prefill_seconds'], 1e-9):.2f}x; "
          f"tok/s (n / lines) {one['tokens'] / one['wall'] / (lines['tokens'] / lines['wall']):.2f}x")
    same = texts[f"n={a.n}"] == texts[f"{a.n} lines"]
    print(f"  round 0 samples identical both ways: {same} (they need not be: batch invariance, docs/DESIGN.md)")


if __name__ == "__main__":
    main()
