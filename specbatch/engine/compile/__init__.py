"""Compiled forward: the whole causal LM through ``torch.compile`` (inductor), caches unchanged.

Why this shape (measured, see docs/COMPILE.md): on CPU most of an eager decode step is not the
matrix products but the Python and dispatch overhead around ~30 layers of small ops, and the
LM head's fp32 GEMM, which eager runs once per row. Compiling only the projections would leave
the overhead; a static KV cache would re-implement rollback, holes and row select/extend, and
measured no faster than this design with the same inductor options. So the whole model is
compiled with dynamic shapes over the unchanged ``DynamicCache``: dynamo replays the cache's
``torch.cat`` appends, so crop / index_select / batch select / extend keep working eagerly
between calls. ``inductor.inductor_options``: ``freezing`` makes the weights constants, and on
CPU max-autotune picks inductor's C++ GEMM per linear, whose cost hardly grows with the rows,
which is what makes verifying k tokens cost little more than one.

Shapes: one graph per (rows == 1 or more) x (tokens == 1 or more) x (kept logits == 1 or more)
(dynamo specializes sizes 0 and 1); the cache length, row count and token count are symbolic
inside each graph, so no padding to buckets is needed. Every call is normalized to the same
signature (explicit 4-D additive mask, position ids, kept-logit indices), so a chain verify, a
tree verify and a batched step share graphs. A forward over an empty cache (prefill) stays eager.

Artefacts live under ``<cache_dir>/inductor``, shared across processes (frozen graphs bypass the
FX graph cache, so what a later start reuses is kernels and autotuning); ``warm_up`` compiles the
graphs a decode will need, times each against eager on this machine, and records both, so later
starts know whether they hit the cache, how long compiling takes and what it buys here. On CPU
the first start compares frozen with ``NOT_FROZEN`` graphs and keeps freezing only where it pays
(``compare_not_frozen``); where the frozen graphs' weight copies do not fit the memory budget,
CPU compiles them ``NOT_FROZEN`` without comparing.

Modules, each calling only those above it:

- ``inductor``: inductor's options and process-wide flags, its on-disk cache location
- ``forward``: ``CompiledForward`` (one call signature, misses counted), ``install``, shape classes
- ``record``: ``CompileReport`` and its on-disk record (``is_cached``, ``recorded_*``)
- ``decision``: measured priors, cost estimates, auto / on / off (``decide``, ``CompilePlan``)
- ``warmup``: the graphs to warm, warming and timing them, frozen against not frozen
- ``prepare``: decide -> install -> warm up -> keep what pays
"""
