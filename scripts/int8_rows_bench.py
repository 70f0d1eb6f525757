"""Row-independent int8 drafts (issue 31): cost, batch invariance and acceptance of each candidate.

    OMP_NUM_THREADS=1 nice -n 5 python scripts/int8_rows_bench.py [linears|model|accept|all] [repeats]

Candidates, each built from the fp32 SmolLM2-135M (the default target; the default draft is its
int8 copy):
  a  dyn    torch.ao quantize_dynamic, per-channel weights: ONE activation scale per Linear input
  b  rows   engine/int8.py RowInt8Linear: per-row activation scales; each row divided by its scale
            in float, then fbgemm's int8 GEMM at scale 1 (exact int32), times the row's scale
  b' rows   the same numbers through torch._int_mm (RowInt8Linear's fallback off fbgemm)
  c  w8     weight-only int8, aten._weight_int8pack_mm (gpt-fast's int8), fp32 activations
  c' w8bf   the same kernel with bf16 activations (its fast path on CPU)
  d  fp32   the fp32 model itself (= the target: its step is the target step)

linears: each Linear shape of the draft (the 576->49152 head is quantized too) at M rows, A B .. B A
  interleaved, µs/call; "rows ok": rows of a (64, K) batch of rows of unequal size that equal, bit
  for bit, the same row computed alone.
model: one draft step (1 token a row, 64 cached) at B rows, interleaved; rows whose last logits (and
  argmax) equal the row's own forward when 8 prompts go through one padded forward (BatchCache).
accept: along the target's greedy continuation (24 tokens) of each prompt of
  examples/job-mixed-48.jsonl: the share of positions where the draft's argmax is the target's
  next token, prompts fed B at a time (prefill padded, then one token a row a forward).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from specbatch.engine.int8 import RowInt8Linear, quantize_linears, row_scales

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
ROWS = [1, 4, 8, 16, 32, 64]


class W8Linear(torch.nn.Module):
    """Weight-only int8 (per-channel scales); activations stay float (``dtype``)."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        q, scale = torch.round(w / row_scales(w)).to(torch.int8), row_scales(w)
        self.weight_q, self.scale, self.dtype = q, scale.reshape(-1).to(dtype), dtype
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_q, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def dequantized(linear: torch.nn.Linear) -> torch.nn.Linear:
    """c's numbers in an fp32 Linear (int8 weights dequantized; fp32 sums in another order): for
    acceptance, where _weight_int8pack_mm's fp32 path would take hours."""
    w = linear.weight.detach().float()
    out = copy.deepcopy(linear)
    out.weight.data = torch.round(w / row_scales(w)) * row_scales(w)
    return out


def swap(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> torch.nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, make(child))
        else:
            swap(child, make)
    return model


def dyn(model: torch.nn.Module) -> torch.nn.Module:
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def timed(f: Callable[[], Any], budget: float = 0.05) -> float:
    """µs per call, over as many calls as fit in ``budget`` seconds (at least 1)."""
    t0 = time.perf_counter()
    f()
    one = time.perf_counter() - t0
    n = max(1, min(200, int(budget / max(one, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def interleaved(fs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median µs/call of each, run in the order a b c .. c b a, ``repeats`` times."""
    names = list(fs)
    got: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(repeats):
        for k in names + names[::-1]:
            got[k].append(timed(fs[k]))
    return {k: statistics.median(v) for k, v in got.items()}


def table(head: list[str]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))


def linears(repeats: int) -> None:
    names = ["a", "b", "b'", "c", "c'", "d"]
    print(f"## Linear shapes, µs/call (median of {2 * repeats}, interleaved), 1 thread")
    table(["K->N", "M", *names, "b/a", "b/d"])
    invariant: dict[tuple[int, int], dict[str, str]] = {}
    for k, n in SHAPES:
        torch.manual_seed(k + n)
        lin = torch.nn.Linear(k, n, bias=False)
        cands = {"a": dyn(torch.nn.Sequential(lin))[0], "b": RowInt8Linear(lin),
                 "b'": RowInt8Linear(lin, fbgemm=False), "c": W8Linear(lin),
                 "c'": W8Linear(lin, torch.bfloat16), "d": lin}
        # rows of unequal size (real activations have outlier rows): each alone vs in the batch
        x = torch.randn(64, k) * torch.logspace(-1, 1, 64)[:, None]
        invariant[(k, n)] = {}
        for name, m in cands.items():
            batch = m(x)
            same = sum(bool(torch.equal(batch[i], m(x[i: i + 1])[0])) for i in range(64))
            invariant[(k, n)][name] = f"{same}/64"
        for rows in ROWS:
            xs = torch.randn(rows, k)
            # (c's fp32 path takes seconds a call on the head at M >= 32: one or two calls there)
            us = interleaved({c: (lambda m=m, xs=xs: m(xs)) for c, m in cands.items()}, repeats)
            print(f"| {k}->{n} | {rows} | " + " | ".join(f"{us[c]:.0f}" for c in names)
                  + f" | {us['b'] / us['a']:.2f} | {us['b'] / us['d']:.2f} |", flush=True)
    print("\n## rows bitwise equal alone and in a batch of 64 (rows of unequal size)")
    table(["K->N", *names])
    for (k, n), inv in invariant.items():
        print(f"| {k}->{n} | " + " | ".join(inv[c] for c in names) + " |")


def load_target() -> Any:
    from specbatch.config import get_settings
    from specbatch.engine.loading import load_model
    return load_model("smollm2-135m", cache_dir=get_settings().cache_dir, linears=get_settings().linears)


def variants(target: Any, which: str) -> dict[str, Any]:
    """LoadedModels sharing the target's tokenizer; ``which``: candidate names wanted."""
    makers: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
        "a": dyn,
        "b": quantize_linears,
        "b'": lambda m: swap(m, lambda lin: RowInt8Linear(lin, fbgemm=False)),
        "c": lambda m: swap(m, W8Linear),
        "c'": lambda m: swap(m, lambda lin: W8Linear(lin, torch.bfloat16)),
        "c~": lambda m: swap(m, dequantized),
        "d": lambda m: m,
    }
    out = {}
    for name in which.split(","):
        lm = copy.copy(target)
        lm.model = makers[name](copy.deepcopy(target.model)).eval()
        out[name] = lm
    return out


def prompts(target: Any, path: str = "examples/job-mixed-48.jsonl") -> list[list[int]]:
    from specbatch.config import Settings
    from specbatch.engine import Engine
    from specbatch.jobs import intake
    enc = Engine(target)
    return [enc.encode(p.prompt, p.messages) for p in intake.parse_file(path, None, Settings.from_env())]


def model(repeats: int) -> None:
    from specbatch.engine.cache import BatchCache

    target = load_target()
    models = variants(target, "a,b,b',c',d")
    ids = prompts(target)
    names = list(models)
    text = [t for p in ids for t in p]      # 65-token windows of the prompts, one a row
    ctx = [[text[(65 * i + j) % len(text)] for j in range(65)] for i in range(32)]
    print("\n## one draft step (1 token a row, 64 cached), ms/step (median, interleaved), 1 thread")
    table(["B", *names, "a/d", "b/d", "b/a"])
    for rows in (1, 4, 8, 16, 32):
        steps = {}
        for name, lm in models.items():
            if name == "c'" and rows > 8:     # grows with M as fast as fp32 does (see the Linears)
                continue
            c = BatchCache(lm, rows)
            c.forward([p[:64] for p in ctx[:rows]], logits_to_keep=1)
            feed = [[p[64]] for p in ctx[:rows]]

            def step(c: Any = c, feed: list[list[int]] = feed) -> None:
                c.forward(feed, logits_to_keep=1)
                c.drop_tail([1] * len(feed))
            steps[name] = step
        ms = {k: v / 1000 for k, v in interleaved(steps, repeats).items()}
        print(f"| {rows} | " + " | ".join(f"{ms[c]:.1f}" if c in ms else "-" for c in names)
              + f" | {ms['a'] / ms['d']:.2f} | {ms['b'] / ms['d']:.2f} | {ms['b'] / ms['a']:.2f} |", flush=True)
    print("\n## 8 prompts in one padded forward vs each alone: rows with equal last logits / argmax")
    table(["candidate", "logits bitwise", "argmax"])
    feeds = ids[:8]
    for name, lm in models.items():
        together = BatchCache(lm, 8).forward(feeds, logits_to_keep=1)[:, -1]
        alone = [BatchCache(lm, 1).forward([f], logits_to_keep=1)[0, -1] for f in feeds]
        same = sum(bool(torch.equal(together[i], alone[i])) for i in range(8))
        arg = sum(int(together[i].argmax()) == int(alone[i].argmax()) for i in range(8))
        print(f"| {name} | {same}/8 | {arg}/8 |", flush=True)


def accept(n_new: int = 24) -> None:
    from specbatch.engine.cache import BatchCache

    target = load_target()
    ids = prompts(target)
    conts = []          # the target's greedy continuation of each prompt, alone
    for p in ids:
        c, seq = BatchCache(target, 1), []
        logits = c.forward([p], logits_to_keep=1)[0, -1]
        for _ in range(n_new):
            seq.append(int(logits.argmax()))
            logits = c.forward([[seq[-1]]], logits_to_keep=1)[0, -1]
        conts.append(seq)
    print(f"\n## draft argmax = target's next token along the target's greedy continuation "
          f"({len(ids)} prompts x {n_new} tokens)")
    table(["candidate", "B=1", "B=8", "B=32", "first token B=1", "first token B=32"])
    for name, lm in variants(target, "a,b,c~,d").items():
        res, first = {}, {}
        for rows in (1, 8, 32):
            hit = tot = first_hit = 0
            for s in range(0, len(ids), rows):
                group = list(range(s, min(s + rows, len(ids))))
                c = BatchCache(lm, len(group))
                logits = c.forward([ids[i] for i in group], logits_to_keep=1)[:, -1]
                for j in range(n_new):
                    for g, i in zip(logits.argmax(-1).tolist(), group):
                        hit += g == conts[i][j]
                        first_hit += j == 0 and g == conts[i][j]
                        tot += 1
                    logits = c.forward([[conts[i][j]] for i in group], logits_to_keep=1)[:, -1]
            res[rows], first[rows] = hit / tot, first_hit
        print(f"| {name} | {res[1]:.3f} | {res[8]:.3f} | {res[32]:.3f} | {first[1]}/{len(ids)} "
              f"| {first[32]}/{len(ids)} |", flush=True)


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, load {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        if what in ("linears", "all"):
            linears(repeats)
        if what in ("model", "all"):
            model(repeats)
        if what in ("accept", "all"):
            accept()
    print(json.dumps({"load_end": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
