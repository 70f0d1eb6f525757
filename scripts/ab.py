"""Two ways of running the default target, A against B in one process, interleaved:

- ``step``: one target forward (T tokens a row over a cache of about L tokens with left pads), rep by
  rep; ms for each and whether the logits are bitwise equal.
- ``job``: the default job (examples/job-mixed-48.jsonl), A B B A per configuration; tok/s and
  whether every output equals the first run's.

``--compare``: ``flat`` (transformers' forward against engine/flat_forward.py's) or ``fold`` (folded
attention, engine/attention.py, against transformers' SDPA path) or
``columns`` (folded attention with its keys padded to
an aligned length, as where ``columns_move``, against as they are) or ``packed`` (Linears over packed weights, engine/packed.py, against ``F.linear``) or ``kernels``
(oneDNN's packed product against MKL's, whether or not each passes its check here).

    python scripts/ab.py step 1x5x200,8x5x200,32x5x200,32x1x200,32x3x400   # rows x tokens x cached
    python scripts/ab.py --compare packed step 1x1x200,1x5x200,4x1x200,8x1x200,32x1x200
    OMP_NUM_THREADS=1 python scripts/ab.py --compare packed job --configs auto,B32plain,B4spec
    OMP_NUM_THREADS=2 python scripts/ab.py --threads 2 --compare kernels job --configs auto,B8plain
    OMP_NUM_THREADS=2 python scripts/ab.py --threads 2 --compare flat step 1x1x200,4x1x200,16x1x200,32x1x200,4x5x200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from specbatch.bench.job import JobConfig, _ours, job_requests
from specbatch.config import Settings
from specbatch.engine import attention as attention_module
from specbatch.engine.attention import NAME
from specbatch.engine.cache import BatchCache
from specbatch.engine.loading import LoadedModel, load_model
from specbatch.engine.packed import KERNELS, PackedLinear, _Packed
from specbatch.jobs import intake

CONFIGS = {"auto": ("auto", "auto"), "B32plain": (32, False), "B32spec": (32, True),
           "B8plain": (8, False), "B8spec": (8, True), "B4plain": (4, False), "B4spec": (4, True)}


def variants(models: list[LoadedModel], compare: str) -> dict[str, Callable[[], None]]:
    """Two named ways of running the same models: each callable switches them to its way."""
    if compare == "flat":
        def flat(on: bool) -> Callable[[], None]:
            def switch() -> None:
                for lm in models:
                    lm.flat = on
            return switch
        return {"transformers'": flat(False), "flat": flat(True)}
    if compare == "fold":
        def attention(mode: str) -> Callable[[], None]:
            def switch() -> None:
                for lm in models:
                    lm.model.set_attn_implementation(mode)
            return switch
        return {"transformers' SDPA": attention("sdpa"), "folded": attention(NAME)}
    if compare == "columns":
        def columns(pad: bool) -> Callable[[], None]:
            def switch() -> None:
                attention_module._columns_move = pad
            return switch
        return {"folded, keys as they are": columns(False), "folded, keys padded": columns(True)}
    packed = [m for lm in models for m in lm.model.modules() if isinstance(m, PackedLinear)]

    def as_class(cls: type) -> Callable[[], None]:
        def switch() -> None:
            for m in packed:
                m.__class__ = cls
        return switch
    if compare == "packed":
        return {"F.linear": as_class(torch.nn.Linear), "packed": as_class(PackedLinear)}
    # kernels: each Linear holds one packed copy per kernel, swapped in by the switch
    copies = {k.name: [_Packed(m.weight, k) for m in packed] for k in KERNELS}

    def kernel(name: str) -> Callable[[], None]:
        def switch() -> None:
            for m, p in zip(packed, copies[name]):
                m._packed = p
        return switch
    return {k.name: kernel(k.name) for k in KERNELS}


def step(target: LoadedModel, shapes: str, reps: int, ways: dict[str, Callable[[], None]]) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in shapes.split(","):
        rows, t, length = (int(x) for x in shape.split("x"))
        times: dict[str, list[float]] = {name: [] for name in ways}
        same = True
        with torch.inference_mode():
            cache = BatchCache(target, rows)
            cache.forward([torch.randint(100, 40000, (length - b % 7,), generator=g).tolist() for b in range(rows)],
                          logits_to_keep=1)          # ragged: left pads, a 4-D mask from here on
            for rep in range(reps):
                tokens = [torch.randint(100, 40000, (t,), generator=g).tolist() for _ in range(rows)]
                logits = []
                order = list(ways.items())
                for name, use in order if rep % 2 == 0 else order[::-1]:
                    use()
                    t0 = time.perf_counter()
                    logits.append(cache.forward(tokens, logits_to_keep=t))
                    times[name].append(time.perf_counter() - t0)
                    cache.drop_tail([t] * rows)
                same = same and torch.equal(*logits)
        (name_a, ms_a), (name_b, ms_b) = ((n, statistics.median(v) * 1e3) for n, v in times.items())
        print(f"B={rows} T={t} L~{length}: {name_a} {ms_a:.1f} ms, {name_b} {ms_b:.1f} ms, "
              f"ratio {ms_a / ms_b:.2f}x, logits bitwise equal: {same}, load {os.getloadavg()[0]:.1f}", flush=True)


def job(target: LoadedModel, draft: LoadedModel, file: str, configs: str,
        ways: dict[str, Callable[[], None]]) -> None:
    parsed = intake.parse_file(file, None, Settings())
    ids, limits = map(list, zip(*job_requests(parsed, target)))
    _ours(target, draft, JobConfig("warm-up", "ours", 2, True), ids[:2], [4, 4])
    first: list[list[int]] | None = None
    rates: dict[tuple[str, str], list[float]] = {}
    order = list(ways.items())
    for rnd, ordered in enumerate((order, order[::-1])):
        for name in configs.split(","):
            batch, spec = CONFIGS[name]
            for way, use in ordered:
                use()
                outs, seconds, _, _ = _ours(target, draft, JobConfig(name, "ours", batch, spec), ids, limits)
                first = first or outs
                n = sum(len(o) for o in outs)
                rates.setdefault((name, way), []).append(n / seconds)
                print(f"round {rnd} {name:9s} {way:18s} {n / seconds:7.1f} tok/s {seconds:6.1f} s  equal to the "
                      f"first run: {sum(x == y for x, y in zip(outs, first))}/{len(outs)}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    (a, _), (b, _) = order
    for name in configs.split(","):
        ra, rb = (sum(rates[(name, w)]) / 2 for w in (a, b))
        print(f"{name:9s} {a} {ra:7.1f}  {b} {rb:7.1f}  {b} / {a} {rb / ra:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", choices=("flat", "fold", "columns", "packed", "kernels"), default="fold")
    ap.add_argument("--threads", type=int, default=1)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("step")
    s.add_argument("shapes", help="comma list of ROWSxTOKENSxCACHED")
    s.add_argument("--reps", type=int, default=6)
    j = sub.add_parser("job")
    j.add_argument("--file", default="examples/job-mixed-48.jsonl")
    j.add_argument("--configs", default="B32spec,B8spec")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    settings = Settings()
    kw = {"cache_dir": settings.cache_dir, "linears": settings.linears}
    target = load_model("smollm2-135m", **kw)
    if a.what == "step":
        step(target, a.shapes, a.reps, variants([target], a.compare))
    else:
        draft = load_model("smollm2-135m-int8", loaded=[target], **kw)
        job(target, draft, a.file, a.configs, variants([target, draft], a.compare))


if __name__ == "__main__":
    main()
