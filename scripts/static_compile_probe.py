"""Does a static-cache compiled target pay on this CPU at the job's shapes? (issue 31; docs/COMPILE.md,
"Static cache at the job's shapes (measured)").

Four probes, each one process, eager and compiled interleaved round by round, 1 torch thread:

- ``linears``: one decoder linear of the default target per (K -> N, M rows), eager ``F.linear`` vs
  ``torch.compile`` with freezing and max-autotune (C++ GEMM template against ATen); ms, GFLOPS, and
  whether the outputs are bitwise equal.
- ``step``: one decode step (1 new token a row) of the whole target at B rows over a cache of about
  ``--prompt-len`` + ``--steps`` tokens: today's eager path (``hf_cache.new_cache()``, a growing
  DynamicCache), eager over a transformers ``StaticCache``, and that static step compiled (fullgraph,
  static shapes). All three start from the same prefilled keys and values and decode greedily,
  each feeding its own argmax; the report says whether tokens and logits match eager.
- ``verify``: T(k), one call scoring k new positions a row (a speculative verify of k - 1 drafts)
  over a static cache rolled back after each call, eager and compiled, every k interleaved; the
  report gives T(k)/T(1) for each (issue 31's goal: compiled <= 1.3 for k - 1 <= 4 at B = 1).
- ``restart``: ``step`` at one batch size run twice in fresh processes sharing one empty
  ``TORCHINDUCTOR_CACHE_DIR``: time to the first compiled step cold and warm, and inductor's FX
  graph cache counters (frozen graphs may bypass it).

Not a test: nothing here asserts on a time. Compiles are bounded by ``--compile-timeout``; run it at
``nice`` on a shared machine, one at a time.

    nice -n 5 python scripts/static_compile_probe.py linears --json /tmp/linears.json
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) nice -n 5 python scripts/static_compile_probe.py step --batch-sizes 32,8,1
    nice -n 5 python scripts/static_compile_probe.py step --force-gqa --batch-sizes 32,8 --steps 33 --rounds 4 --cache-len 258
    nice -n 5 python scripts/static_compile_probe.py verify --batch-sizes 1 --positions 1,2,3,4,5
    nice -n 5 python scripts/static_compile_probe.py restart --batch-sizes 32 --steps 9 --rounds 2 --cache-len 258

``--force-gqa``: under dynamo transformers' SDPA path expands the cache to every query head
(``repeat_kv``) where eager folds the heads instead; this flag makes both call SDPA's own GQA.
Measured results and what they mean: docs/COMPILE.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# the default target's decoder linears (SmolLM2-135M: hidden 576, intermediate 1536, 3 KV heads of 64)
LINEAR_SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192),
                 "gate/up 576->1536": (576, 1536), "down 1536->576": (1536, 576)}
HEAD_SHAPE = {"head 576->49152": (576, 49152)}


def configure(mode: str, freezing: bool) -> None:
    """Inductor as the issue asks: frozen weights, and under max-autotune its C++ GEMM template
    timed against ATen per GEMM (Triton is GPU-only; leaving it in only costs probing)."""
    import torch._inductor.config as ic

    torch.set_num_threads(1)
    ic.freezing = freezing
    ic.compile_threads = 1              # no worker pool on a shared 2-core machine
    ic.fx_graph_cache = True
    ic.autotune_local_cache = True
    if mode.startswith("max-autotune"):
        ic.max_autotune_gemm_backends = "CPP,ATEN"
        ic.max_autotune_report_choices_stats = False
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256


class CompileTimeout(Exception):
    pass


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Interrupt a compile that runs past ``seconds`` (compile_threads=1: it runs in this thread)."""
    def fire(*_: Any) -> None:
        raise CompileTimeout(f"compile took over {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def inductor_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters
    keys = ("cpp_templated_kernel_counter", "fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    return {k: int(counters["inductor"][k]) for k in keys}


def compiled(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    return torch.compile(fn, mode=None if mode == "default" else mode, fullgraph=True, dynamic=False)


def interleaved(variants: Mapping[str, Callable[[], Any]], rounds: int, reps: int) -> dict[str, list[float]]:
    """ms per call of each variant, one entry per round; within a round the variants run in turn."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out[name].append((time.perf_counter() - t0) * 1e3 / reps)
    return out


def ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b: round pairs ran back to back, so the load they saw is alike."""
    return statistics.median(x / y for x, y in zip(a, b))


# ---------------------------------------------------------------- linears


def probe_linears(args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = LINEAR_SHAPES | (HEAD_SHAPE if args.with_head else {})
    rows = []
    for name, (k, n) in shapes.items():
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False).eval()
        for m in args.ms:
            x = torch.randn(m, k)
            before = inductor_counts()
            fn = compiled(lin, args.mode)
            t0 = time.perf_counter()
            try:
                with torch.no_grad(), deadline(args.compile_timeout):
                    got = fn(x)
            except CompileTimeout as e:
                rows.append({"shape": name, "M": m, "error": str(e)})
                continue
            compile_s = time.perf_counter() - t0
            templates = inductor_counts()["cpp_templated_kernel_counter"] - before["cpp_templated_kernel_counter"]
            with torch.no_grad():
                want = F.linear(x, lin.weight)
                eager_call = partial(F.linear, x, lin.weight)
                reps = max(3, int(20e-3 / max(time_once(eager_call), 1e-6)))
                ms = interleaved({"eager": eager_call, "compiled": partial(fn, x)}, args.rounds, reps)
            eager, comp = statistics.median(ms["eager"]), statistics.median(ms["compiled"])
            flops = 2 * m * k * n
            rows.append({"shape": name, "M": m, "eager_ms": eager, "compiled_ms": comp,
                         "eager_gflops": flops / eager / 1e6, "compiled_gflops": flops / comp / 1e6,
                         "speedup": ratio(ms["eager"], ms["compiled"]), "compile_s": compile_s,
                         "cpp_template_kernels": templates, "bitwise_equal": bool(torch.equal(got, want)),
                         "max_abs_diff": float((got - want).abs().max())})
            print(fmt_linear(rows[-1]), flush=True)
            del fn
            torch._dynamo.reset()
    return rows


def time_once(fn: Callable[[], Any]) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fmt_linear(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['shape']} | {r['M']} | {r['error']} |"
    return (f"| {r['shape']} | {r['M']} | {r['eager_ms']:.3f} | {r['compiled_ms']:.3f} | "
            f"{r['eager_gflops']:.0f} | {r['compiled_gflops']:.0f} | {r['speedup']:.2f}x | "
            f"{r['compile_s']:.0f} | {r['cpp_template_kernels']} | "
            f"{'yes' if r['bitwise_equal'] else 'no'} ({r['max_abs_diff']:.1e}) |")


LINEAR_HEADER = ("| linear (K->N) | M | eager ms | compiled ms | eager GFLOPS | compiled GFLOPS | "
                 "compiled/eager speed | compile s | C++ GEMM kernels | bitwise equal (max abs diff) |\n"
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


# ---------------------------------------------------------------- whole step


def job_rows(tokenizer: Any, batch: int, length: int) -> torch.Tensor:
    """(B, length) token ids of real text: the job's prompts, concatenated in turn from a different
    start per row until each row is ``length`` tokens (so no padding and one cache length)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "job-mixed-48.jsonl"
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in path.read_text().splitlines() if line]
    rows = []
    for b in range(batch):
        ids: list[int] = []
        i = b
        while len(ids) < length:
            ids += prompts[i % len(prompts)]
            i += 1
        rows.append(ids[:length])
    return torch.tensor(rows)


class Decoder:
    """One way to run the target's decode step, fed its own greedy tokens; keeps each step's logits."""

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], first: torch.Tensor) -> None:
        self.step, self.next = step, first
        self.logits: list[torch.Tensor] = []

    def __call__(self) -> None:
        logits = self.step(self.next)          # (B, V) logits of the new position
        self.logits.append(logits.clone())
        self.next = logits.argmax(-1, keepdim=True)


def growing_step(model: Any, cache: Any, length: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Today's eager path: the growing DynamicCache, a 2-D mask of ones, explicit positions."""
    from specbatch.engine.hf_cache import cache_kwarg
    kw = cache_kwarg(model)

    def step(ids: torch.Tensor) -> torch.Tensor:
        b, n = ids.shape[0], length[0]
        pos = torch.full((b, 1), n)
        mask = torch.ones(b, n + 1, dtype=torch.long)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache})
        length[0] += 1
        return out.logits[:, -1]
    return step


def static_cache_from(model: Any, prefilled: Any, max_len: int) -> Any:
    """A transformers StaticCache of ``max_len`` columns holding ``prefilled``'s keys and values."""
    from transformers import StaticCache

    from specbatch.engine.hf_cache import kv_layers
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    layer: Any
    for layer, src in zip(cache.layers, kv_layers(prefilled)):
        k, v = src.keys, src.values
        layer.lazy_initialization(k, v)
        layer.keys[:, :, : k.shape[2]] = k
        layer.values[:, :, : v.shape[2]] = v
        layer.cumulative_length.fill_(k.shape[2])
    return cache


def static_step(model: Any, cache: Any, max_len: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The static-shape step: (B, 1) ids, (B, 1) positions, (B, 1, 1, max_len) additive mask ->
    (B, V) logits; the cache's write position is its own tensor (``cumulative_length``)."""
    from specbatch.engine.hf_cache import cache_kwarg
    kw = cache_kwarg(model)

    def step(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache})
        return out.logits[:, -1]
    return step


def static_inputs(cache: Any, batch: int, max_len: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The step's position and mask at the cache's current length (built outside the graph)."""
    def inputs(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = int(cache.layers[0].cumulative_length)
        pos = torch.full((batch, 1), n)
        mask = torch.zeros(batch, 1, 1, max_len)
        mask[..., n + 1:] = torch.finfo(torch.float32).min
        return ids, pos, mask
    return inputs


def through(step: Callable[..., torch.Tensor],
            inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A static step taking the next ids only: ``inputs`` adds positions and mask."""
    return lambda ids: step(*inputs(ids))


def probe_step(args: argparse.Namespace, lm: Any) -> list[dict[str, Any]]:
    from specbatch.engine.hf_cache import new_cache
    model, rows = lm.model, []
    max_len = args.cache_len or args.prompt_len + args.steps + 1
    assert max_len > args.prompt_len + args.steps, "the static cache must hold every decoded token"
    for batch in args.batch_sizes:
        ids = job_rows(lm.tokenizer, batch, args.prompt_len)
        with torch.inference_mode():
            cache = new_cache()
            t0 = time.perf_counter()
            first = model(input_ids=ids, use_cache=True, **{_kw(model): cache}).logits[:, -1].argmax(-1, keepdim=True)
            prefill_s = time.perf_counter() - t0
            decoders: dict[str, Decoder] = {"eager": Decoder(growing_step(model, cache, [args.prompt_len]), first)}
            if args.eager_static:
                sc = static_cache_from(model, cache, max_len)
                st, si = static_step(model, sc, max_len), static_inputs(sc, batch, max_len)
                decoders["eager static"] = Decoder(through(st, si), first)
            cc = static_cache_from(model, cache, max_len)
            fn, ci = compiled(static_step(model, cc, max_len), args.mode), static_inputs(cc, batch, max_len)
            before = inductor_counts()
            row: dict[str, Any] = {"B": batch, "prompt_len": args.prompt_len, "max_len": max_len,
                                   "prefill_s": prefill_s}
            for d in decoders.values():
                d()     # step 0, untimed, so every decoder is at the same length as the compiled one
            t0 = time.perf_counter()
            try:
                with deadline(args.compile_timeout):
                    comp = Decoder(through(fn, ci), first)
                    comp()
            except CompileTimeout as e:
                rows.append(row | {"error": str(e)})
                print(f"B={batch}: {e}", flush=True)
                continue
            row["first_compiled_step_s"] = time.perf_counter() - t0
            after = inductor_counts()
            row |= {k: after[k] - before[k] for k in after}
            decoders["compiled static"] = comp
            per_round = max(1, (args.steps - 1) // args.rounds)
            ms = interleaved(decoders, args.rounds, per_round)
        row["ms"] = {name: statistics.median(v) for name, v in ms.items()}
        row["eager_over"] = {name: ratio(ms["eager"], v) for name, v in ms.items() if name != "eager"}
        row["match"] = {name: agreement(decoders["eager"].logits, d.logits)
                        for name, d in decoders.items() if name != "eager"}
        rows.append(row)
        print(fmt_step(row), flush=True)
        del decoders, fn, cache, cc
        torch._dynamo.reset()
        gc.collect()
    return rows


def _kw(model: Any) -> str:
    from specbatch.engine.hf_cache import cache_kwarg
    return cache_kwarg(model)


def agreement(want: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any]:
    """Greedy tokens and logits of ``got`` against eager's, step by step, up to the first step
    where some row's token differs (after that the rows decode different text)."""
    steps = min(len(want), len(got))
    first_diverged, diff, bitwise = None, 0.0, True
    for s in range(steps):
        diff = max(diff, float((want[s] - got[s]).abs().max()))
        bitwise = bitwise and bool(torch.equal(want[s], got[s]))
        if not torch.equal(want[s].argmax(-1), got[s].argmax(-1)):
            first_diverged = s
            break
    return {"steps": steps, "tokens_identical": first_diverged is None, "first_diverged_step": first_diverged,
            "logits_bitwise_equal": bitwise, "max_abs_logit_diff": diff}


def fmt_step(r: dict[str, Any]) -> str:
    ms, m = r["ms"], r["match"]["compiled static"]
    es = r["match"].get("eager static")
    return (f"| {r['B']} | {ms['eager']:.1f} | "
            + (f"{ms['eager static']:.1f} | " if es else "- | ")
            + f"{ms['compiled static']:.1f} | {r['eager_over']['compiled static']:.2f}x | "
            + f"{r['first_compiled_step_s']:.0f} | {r['cpp_templated_kernel_counter']} | "
            + (f"{_match(es)} | " if es else "- | ") + f"{_match(m)} |")


def _match(m: dict[str, Any]) -> str:
    toks = f"{m['steps']} steps identical" if m["tokens_identical"] else f"diverged at step {m['first_diverged_step']}"
    bits = "bitwise" if m["logits_bitwise_equal"] else f"max diff {m['max_abs_logit_diff']:.1e}"
    return f"{toks}, {bits}"


STEP_HEADER = ("| B | eager ms/step | eager static ms/step | compiled static ms/step | eager/compiled | "
               "first compiled step s | C++ GEMM kernels | eager static vs eager | compiled vs eager |\n"
               "|---:|---:|---:|---:|---:|---:|---:|---|---|")


# ---------------------------------------------------------------- verify: T(k)/T(1)


def verify_inputs(n: int, batch: int, k: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, k) and the additive causal mask (B, 1, k, max_len) of k tokens scored after
    ``n`` cached ones: position n + i sees columns 0..n + i."""
    pos = torch.arange(n, n + k).expand(batch, k)
    cols = torch.arange(max_len)
    mask = torch.where(cols[None, :] <= pos[0][:, None], 0.0, torch.finfo(torch.float32).min)
    return pos, mask.expand(batch, 1, k, max_len).contiguous()


def probe_verify(args: argparse.Namespace, lm: Any) -> list[dict[str, Any]]:
    """T(k): one target call scoring k new positions a row (what a speculative verify of k - 1
    drafts costs), over a static cache rolled back after every call, eager and compiled, all k
    interleaved round by round; the issue's goal is compiled T(k)/T(1) <= 1.3 for k - 1 <= 4."""
    from specbatch.engine.hf_cache import new_cache
    model, rows = lm.model, []
    max_len = args.cache_len or args.prompt_len + max(args.positions) + 1
    for batch in args.batch_sizes:
        ids = job_rows(lm.tokenizer, batch, args.prompt_len + max(args.positions))
        prompt, fed = ids[:, : args.prompt_len], ids[:, args.prompt_len:]
        variants: dict[str, Callable[[], Any]] = {}
        outs: dict[str, torch.Tensor] = {}
        compile_s: dict[int, float] = {}
        with torch.inference_mode():
            cache = new_cache()
            model(input_ids=prompt, use_cache=True, **{_kw(model): cache})
            for k in args.positions:
                pos, mask = verify_inputs(args.prompt_len, batch, k, max_len)
                for kind in ("eager", "compiled"):
                    sc = static_cache_from(model, cache, max_len)
                    step = static_step_all(model, sc)
                    if kind == "compiled":
                        step = compiled(step, args.mode)
                        t0 = time.perf_counter()
                        try:
                            with deadline(args.compile_timeout):
                                rolled_back(step, sc, args.prompt_len, fed[:, :k], pos, mask)
                        except CompileTimeout as e:
                            print(f"B={batch} k={k}: {e}", flush=True)
                            continue
                        compile_s[k] = time.perf_counter() - t0
                    variants[f"{kind} {k}"] = partial(rolled_back, step, sc, args.prompt_len, fed[:, :k], pos, mask)
                    outs[f"{kind} {k}"] = variants[f"{kind} {k}"]()
            ms = interleaved(variants, args.rounds, args.reps)
        for k in args.positions:
            if f"compiled {k}" not in variants:
                continue
            row = {"B": batch, "k": k, "compile_s": compile_s[k]}
            for kind in ("eager", "compiled"):
                row[f"{kind}_ms"] = statistics.median(ms[f"{kind} {k}"])
                row[f"{kind}_over_1"] = ratio(ms[f"{kind} {k}"], ms[f"{kind} {args.positions[0]}"])
            got, want = outs[f"compiled {k}"], outs[f"eager {k}"]
            row["tokens_identical"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
            row["max_abs_logit_diff"] = float((got - want).abs().max())
            rows.append(row)
            print(f"| {batch} | {k} | {row['eager_ms']:.1f} | {row['eager_over_1']:.2f} | {row['compiled_ms']:.1f} | "
                  f"{row['compiled_over_1']:.2f} | {row['compile_s']:.0f} | "
                  f"{'yes' if row['tokens_identical'] else 'no'} ({row['max_abs_logit_diff']:.1e}) |", flush=True)
        del variants, outs, cache
        torch._dynamo.reset()
        gc.collect()
    return rows


def static_step_all(model: Any, cache: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``static_step`` keeping every fed position's logits: (B, k) ids -> (B, k, V)."""
    from specbatch.engine.hf_cache import cache_kwarg
    kw = cache_kwarg(model)

    def step(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache}).logits
    return step


def rolled_back(step: Callable[..., torch.Tensor], cache: Any, n: int, *inputs: torch.Tensor) -> torch.Tensor:
    """One call, then the cache back at ``n`` columns (a rejected draft's roll-back)."""
    out = step(*inputs)
    for layer in cache.layers:
        layer.cumulative_length.fill_(n)
    return out.clone()


VERIFY_HEADER = ("| B | k scored | eager static ms | eager T(k)/T(1) | compiled static ms | compiled T(k)/T(1) | "
                 "compile s | greedy equal to eager (max logit diff) |\n"
                 "|---:|---:|---:|---:|---:|---:|---:|---|")


# ---------------------------------------------------------------- restart


def probe_restart(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``step`` twice in fresh processes over one empty inductor cache directory; with
    ``--inductor-cache-dir`` (a directory an earlier ``step`` run compiled into), once, warm."""
    out = []
    with tempfile.TemporaryDirectory(prefix="static-probe-inductor-") as tmp:
        d = args.inductor_cache_dir or tmp
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": d}
        for start in ("warm",) if args.inductor_cache_dir else ("cold", "warm"):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "step", "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                       "--mode", args.mode, "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
                       "--rounds", str(args.rounds), "--compile-timeout", str(args.compile_timeout),
                       "--cache-len", str(args.cache_len), *([] if args.freezing else ["--no-freezing"]),
                       "--no-eager-static", "--json", f.name]
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True)
                wall = time.perf_counter() - t0
                for r in json.loads(Path(f.name).read_text())["step"]:
                    out.append({"start": start, "process_wall_s": wall} | r)
    for r in out:
        print(f"| {r['start']} | {r['B']} | {r.get('first_compiled_step_s', float('nan')):.0f} | "
              f"{r['process_wall_s']:.0f} | {r.get('fxgraph_cache_hit')} | {r.get('fxgraph_cache_miss')} | "
              f"{r.get('fxgraph_cache_bypass')} |")
    return out


# ---------------------------------------------------------------- CLI


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=["linears", "step", "verify", "restart"])
    p.add_argument("--mode", default="max-autotune-no-cudagraphs", help="torch.compile mode, or 'default'")
    p.add_argument("--ms", type=ints, default=[1, 4, 8, 16, 32, 64], help="linears: rows per GEMM")
    p.add_argument("--with-head", action="store_true", help="linears: the 576->49152 LM head too")
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=192, help="step: cache length at the first step")
    p.add_argument("--steps", type=int, default=65, help="step: decode steps per variant")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--positions", type=ints, default=[1, 2, 3, 4, 5],
                   help="verify: tokens scored a row per call (k; a verify of k - 1 drafts)")
    p.add_argument("--reps", type=int, default=5, help="verify: calls per variant per round")
    p.add_argument("--no-eager-static", dest="eager_static", action="store_false",
                   help="step: leave out the eager forward over the static cache")
    p.add_argument("--compile-timeout", type=int, default=900, help="seconds per compile before giving up")
    p.add_argument("--cache-len", type=int, default=0,
                   help="step: static cache columns (default prompt-len + steps + 1; the graph's shape)")
    p.add_argument("--no-freezing", dest="freezing", action="store_false",
                   help="compile without freezing: weights stay inputs, linears stay ATen's (sgemm)")
    p.add_argument("--force-gqa", action="store_true",
                   help="step: TRANSFORMERS_SDPA_FORCE_GQA=1, SDPA's enable_gqa instead of repeat_kv under dynamo")
    p.add_argument("--inductor-cache-dir", help="restart: reuse this TORCHINDUCTOR_CACHE_DIR (warm start only)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.probe == "linears":
        args.rounds = max(args.rounds, 5)
    if args.force_gqa:   # transformers reads it at each attention call; the restart's children inherit it
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    configure(args.mode, args.freezing)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, mode {args.mode}, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    result: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "load_before": load}
    if args.probe == "linears":
        print(LINEAR_HEADER, flush=True)
        result["linears"] = probe_linears(args)
    elif args.probe in ("step", "verify"):
        from specbatch.config import Settings
        from specbatch.engine.loading import load_model
        s = Settings()
        lm = load_model(s.default_target, device="cpu", dtype="float32", cache_dir=s.cache_dir or None,
                        linears=s.linears)
        print(STEP_HEADER if args.probe == "step" else VERIFY_HEADER, flush=True)
        result[args.probe] = (probe_step if args.probe == "step" else probe_verify)(args, lm)
    else:
        print("| start | B | first compiled step s | process wall s | FX cache hit | miss | bypass |\n"
              "|---|---:|---:|---:|---:|---:|---:|", flush=True)
        result["restart"] = probe_restart(args)
    result["load_after"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
