"""Where a job's time goes, per target forward: GEMMs, attention, the head and sampling, KV-cache
management, the rest of the layers' element-wise work, and what no operator accounts for (Python,
dispatch, the decoder's own bookkeeping). And the machine's fp32 GEMM peak, to say how far the
job's useful work is from it.

One extra pass of a configuration under ``torch.profiler`` (not the timed one: the profiler's own
cost would bias the tokens/s). Operators are put in buckets by name; a matrix multiply whose
weight has the vocabulary's width is the head, not a layer's GEMM, and a cache-management operator
called from the rotary embedding (RoPE's ``rotate_half`` concatenates the halves of q and k) is
element-wise work: the profiler records the Python callers for that. Operator times are self times on
the calling thread (intra-op threads work inside them), so the buckets plus "Python and dispatch"
add up to the pass's wall time. See the section "Where the time goes" of specbatch/bench/README.md.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm",
                      "quantized::linear_dynamic", "aten::_weight_int8pack_mm",
                      # engine/packed.py: a float32 Linear on CPU; engine/blocks.py: one over llama.cpp's blocks
                      "mkl::_mkl_linear", "mkldnn::_linear_pointwise", "specbatch_blocks::q4_1",
                      "specbatch_blocks::q8_0", "specbatch_blocks::q6_k"})
ATTENTION_PREFIX = "aten::_scaled_dot_product"
SAMPLING_OPS = frozenset({"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax",
                          "aten::argmax", "aten::max", "aten::topk", "aten::sort", "aten::multinomial",
                          "aten::cumsum", "aten::exponential_"})
CACHE_OPS = frozenset({"aten::cat", "aten::index", "aten::index_select", "aten::gather", "aten::copy_",
                       "aten::index_put_", "aten::masked_fill_", "aten::constant_pad_nd", "aten::zeros",
                       "aten::empty", "aten::new_zeros", "aten::new_empty", "aten::fill_", "aten::clone",
                       "aten::contiguous", "aten::sum", "aten::nonzero", "aten::full"})
# Python callers (the profiler's frames, "file.py(line): function") whose operators are the rotary
# embedding's: transformers' rotate_half / apply_rotary_pos_emb and the rotary module's forward
# (wrapped by modeling_rope_utils' dynamic_rope_update), other models' apply_rotary_emb
ROTARY_FUNCTIONS = frozenset({"rotate_half", "apply_rotary_pos_emb", "apply_rotary_emb"})
ROTARY_FILE = "modeling_rope_utils.py"
BUCKETS = ("gemm", "attention", "head_and_sampling", "cache_management", "elementwise", "python_and_dispatch")


def gemm_peak_gflops(k: int, n: int, rows: tuple[int, ...] = (32, 64), repeats: int = 20,
                     linears: str = "auto") -> float:
    """The best fp32 GFLOPS of one (rows x k) @ (k x n) product, over ``rows``: a layer's linear at
    the job's batch sizes (the same threads as the job), by ``sgemm`` and, by ``linears``'s packed
    product too where the job's target packs its weights (engine/packed.py: ``packed_kernel``):
    the faster of the two is the peak."""
    from specbatch.engine.packed import PackedLinear, kernel

    best = 0.0
    plain = torch.nn.Linear(k, n, bias=False)
    products = [plain] + ([PackedLinear.of(torch.nn.Linear(k, n, bias=False), linears=linears)]
                          if kernel(linears) is not None else [])
    with torch.inference_mode():
        for linear in products:
            for m in rows:
                x = torch.randn(m, k)
                for _ in range(3):
                    linear(x)
                best = max(best, 2 * m * k * n / fastest(functools.partial(linear, x), repeats) / 1e9)
    return best


def fastest(call: Callable[[], Any], repeats: int, trials: int = 5) -> float:
    """Seconds a ``call`` takes: the fastest of ``trials`` means over ``repeats`` calls. A peak is
    what the machine can do: one trial a busy neighbour interrupted (a 32-row product lasts tens
    of microseconds) must not set it (the bench read 14 GFLOPS on a Zen 5 whose peak is 490)."""
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def _bucket(name: str, shapes: list[Any], vocab: int, callers: Sequence[str] = ()) -> str:
    """``callers``: the names of the events enclosing this operator, innermost first (Python frames
    when the profiler records stacks); only read for cache-management operators."""
    if name in GEMM_OPS:
        # (a block product's weight is (N/32, K, ...) tiles: the head's N is the vocabulary)
        head = any(vocab in s for s in shapes if isinstance(s, list)) or \
            (name.startswith("specbatch_blocks::") and len(shapes) > 1 and shapes[1][:1] == [vocab // 32])
        return "head_and_sampling" if head else "gemm"
    if name.startswith(ATTENTION_PREFIX):
        return "attention"
    if name in SAMPLING_OPS:
        return "head_and_sampling"
    if name in CACHE_OPS:
        return "elementwise" if any(_rotary(frame) for frame in callers) else "cache_management"
    return "elementwise"


RECORD_EVERY = 4      # one decoder step in four recorded (profile_pass)


def profile_pass(run: Callable[[], Any], model: torch.nn.Module, vocab: int,
                 every: int = RECORD_EVERY) -> dict[str, Any]:
    """Run ``run()`` once under the profiler; seconds per bucket, per target forward, and shares.
    ``model``: the target's module, whose forward calls are counted (one per decoder step).

    One step in ``every`` is recorded (the middle one of each ``every``: not the job's first, a
    prefill longer than the steps that follow, which one in ``every`` would count ``every`` times
    over), and read back after the pass, one step at a time: recording every step of the default job held 2
    million events, 13 GB, and took two minutes to read back, for a 7 s pass. Reading a step back
    during the pass would make the next step seconds long, and the autopilot choose by that. A
    step runs from one target forward's start to the next's; the buckets are the recorded steps'."""
    import warnings

    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    phase = every // 2
    seconds = dict.fromkeys(BUCKETS, 0.0)
    # each target forward's start, before and after the profiler's step (which starts and stops
    # its traces: not the step's own time): step r runs from forward r-1 to forward r
    before: list[float] = []
    after: list[float] = []
    traces: list[Any] = []            # each recorded step's trace, unread

    def recorded(step: int) -> bool:
        # step 0 runs up to the first forward (set-up); step r >= 1 is forward r-1's decoder
        # step, the profiler warmed up the step before
        return step >= 1 and (step - 1) % every == phase

    def action(step: int) -> ProfilerAction:
        if recorded(step):
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if step % every == phase else ProfilerAction.NONE

    # (with_stack: Python callers are events too, the parents of the operators they call; each
    # recorded step gets a profiler of its own, which torch warns "clears events" of the last)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, schedule=action,
                     on_trace_ready=lambda p: traces.append(p.profiler)) as prof:
            def step(*_: Any) -> None:
                before.append(time.perf_counter())
                prof.step()
                after.append(time.perf_counter())

            hook = model.register_forward_pre_hook(step)
            try:
                t0 = time.perf_counter()
                run()
                end = time.perf_counter()
            finally:
                hook.remove()
    while traces:                     # read back one at a time, each let go once read
        for e in traces.pop().function_events:
            if e.name.startswith(("aten::", "quantized::", "mkl::", "mkldnn::", "specbatch_blocks::")):
                callers = _callers(e) if e.name in CACHE_OPS else []
                seconds[_bucket(e.name, list(e.input_shapes or []), vocab, callers)] += e.self_cpu_time_total / 1e6
    began, ended = [t0, *after], [*before, end]      # step r: began[r] to ended[r]
    steps = [r for r in range(len(ended)) if recorded(r)]
    wall = sum(ended[r] - began[r] for r in steps)
    seconds["python_and_dispatch"] = max(0.0, wall - sum(seconds.values()))
    n = max(len(steps), 1)
    return {"wall_seconds": end - t0, "target_forwards": len(before), "recorded_steps": len(steps),
            "ms_per_forward": {k: 1000 * v / n for k, v in seconds.items()},
            "share": {k: v / wall if wall else 0.0 for k, v in seconds.items()}}


def _rotary(frame: str) -> bool:
    path, _, function = frame.rpartition("): ")
    return function in ROTARY_FUNCTIONS or path.split("(")[0].endswith(ROTARY_FILE)


def _callers(event: Any) -> list[str]:
    """The names of the events enclosing a profiler event, innermost first."""
    out = []
    parent = event.cpu_parent
    while parent is not None:
        out.append(parent.name)
        parent = parent.cpu_parent
    return out


def peak_share(tokens_per_second: float | None, parameters: int, peak_gflops: float) -> float | None:
    """Useful work (2 FLOPs per parameter per generated token) over the GEMM peak."""
    if not tokens_per_second or not peak_gflops:
        return None
    return tokens_per_second * 2 * parameters / (peak_gflops * 1e9)


def markdown_lines(b: dict[str, Any]) -> list[str]:
    ms, share = b["ms_per_forward"], b["share"]
    head = "| " + " | ".join(k.replace("_", " ") for k in BUCKETS) + " |"
    return [f"Where ours-auto's time goes (one profiled pass, {b['target_forwards']} target forwards, "
            f"{b['wall_seconds']:.1f} s, {b['recorded_steps']} of its steps recorded): ms per forward "
            "(share of the recorded steps).", "",
            head, "|" + "---:|" * len(BUCKETS),
            "| " + " | ".join(f"{ms[k]:.1f} ({share[k]:.0%})" for k in BUCKETS) + " |"]
