"""The static-slot target backend (engine/static_cache.py) decodes what ``BatchCache`` decodes.

Two levels: the backend alone, driven op by op beside a ``BatchCache`` (forwards of chains and
trees, rejections, crops, rows leaving, joining, forking, a loaded prefix, bucket moves and
compaction), every forward's logits compared; and the whole decode loop through ``Engine`` with
the static backend against the target's own greedy decoding and against ``BatchCache``.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specbatch.engine import Engine, GenerationParams
from specbatch.engine.cache import BatchCache
from specbatch.engine.compile.forward import StaticForward
from specbatch.engine.compile.static import prepare_static, static_classes
from specbatch.engine.drafter_specs import NGRAM
from specbatch.engine.engine import EngineRequest
from specbatch.engine.loading import load_model
from specbatch.engine.static_cache import StaticBatchCache, columns_for, slots_for
from tests.engine.test_greedy_exact import DRAFTS, target_greedy

PROMPTS = ["Write a haiku about", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The",
           "a", "hello world hello world hello", "for i in range(10):\n    print(i)", "x = 1\ny = 2\nz ="]


@pytest.mark.parametrize(("long_tail", "columns"), [
    (384, [64, 64, 128, 384, 384, 512, 640, 896, 1024]),    # 256 -> 384, 768 -> 896
    (512, [64, 64, 128, 512, 512, 512, 640, 1024, 1024]),   # 256 -> 512, 768 -> 1024
])
def test_buckets(monkeypatch, long_tail, columns):
    assert [slots_for(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]
    # 64, 128, then multiples of 128 as attention._aligned keeps them on a CPU of either long tail
    monkeypatch.setattr("specbatch.engine.attention._long_tail", long_tail)
    assert [columns_for(n) for n in (1, 64, 65, 129, 384, 385, 513, 700, 1024)] == columns


class _Pair:
    """A BatchCache and a StaticBatchCache fed the same operations; every forward's logits compared."""

    def __init__(self, target, n_rows: int = 0, graphs: StaticForward | None = None) -> None:
        self.target = target
        self.ref, self.static = BatchCache(target, n_rows), StaticBatchCache(target, n_rows, graphs)

    def forward(self, feeds, keep, parents=None):
        a = self.ref.forward(feeds, keep, parents)
        b = self.static.forward(feeds, keep, parents)
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
        assert torch.equal(self.static.valid, self.ref.valid) and torch.equal(self.static.n_valid, self.ref.n_valid)
        return a

    def both(self, name, *args):
        getattr(self.ref, name)(*args)
        getattr(self.static, name)(*args)
        assert torch.equal(self.static.valid, self.ref.valid), name


@pytest.mark.parametrize(("seed", "fixed"), [(0, None), (1, None), (2, None), (3, None), (0, 96), (1, 96)])
def test_every_operation_matches_batch_cache(load, seed, fixed, monkeypatch):
    """Random steps over a batch that grows past its slot and column buckets, shrinks, forks and
    compacts: the same logits as BatchCache at every forward (the same valid columns throughout).
    ``fixed``: over graphs of one column capacity (CUDA's, ``StaticForward.columns``; no class
    eligible here, so every call is eager): the buffers never narrower than it."""
    rnd = random.Random(seed)
    target = load("llama")
    vocab = target.vocab_size
    graphs = None if fixed is None else StaticForward(target.model, target.name, target.device, [], columns=fixed)
    Pair = functools.partial(_Pair, graphs=graphs)  # noqa: N806 - every pair of this test over the same graphs
    monkeypatch.setattr(BatchCache, "compact_min_cols", 16)   # compaction happens here too
    gathered = []
    gather = StaticBatchCache._gather
    monkeypatch.setattr(StaticBatchCache, "_gather", lambda self, order: (gathered.append(1), gather(self, order)))
    with torch.inference_mode():
        pair = Pair(target, 3)
        pair.forward([[rnd.randrange(vocab) for _ in range(rnd.randint(1, 12))] for _ in range(3)], 2)
        slots, caps = set(), set()
        for step in range(40):
            n = pair.ref.n_rows
            op = rnd.choice(["chain", "chain", "tree", "drop", "select", "fork", "extend", "prefix"])
            if step == 20:   # a long prompt joins: the columns move up a bucket at least once
                op, n = "extend", min(n, 11)
            if op in ("chain", "tree"):
                widths = [rnd.randint(1, 5) for _ in range(n)]
                feeds = [[rnd.randrange(vocab) for _ in range(w)] for w in widths]
                parents = None
                if op == "tree":
                    parents = [[-1] + [rnd.randrange(i) for i in range(1, w)] for w in widths]
                pair.forward(feeds, max(widths), parents)
                pair.both("reject", [[i for i in range(len(f)) if rnd.random() < 0.4] for f in feeds])
            elif op == "drop":
                pair.both("drop_tail", [rnd.randint(0, min(2, int(v))) for v in pair.ref.n_valid])
            elif op == "select" and n > 1:
                pair.both("select", sorted(rnd.sample(range(n), rnd.randint(1, n - 1))))
            elif op == "fork" and n < 12:
                pair.both("fork", [rnd.randrange(n) for _ in range(rnd.randint(1, 2 * n))])
            elif op == "extend" and n < 12:
                m = rnd.randint(1, 4)
                feeds = [[rnd.randrange(vocab) for _ in range(100 if step == 20 and not j else rnd.randint(1, 40))]
                         for j in range(m)]
                joining = Pair(target, m)
                joining.forward(feeds, 1)
                pair.ref.extend(joining.ref)
                pair.static.extend(joining.static)
            elif op == "prefix" and n < 12:
                alone = Pair(target, 1)
                alone.forward([[rnd.randrange(vocab) for _ in range(rnd.randint(2, 20))]], 1)
                m = rnd.randint(1, 3)
                joining = Pair(target, m)
                joining.ref.load_prefix(alone.ref.export_prefix())
                joining.static.load_prefix(alone.static.export_prefix())
                joining.forward([[rnd.randrange(vocab)] for _ in range(m)], 1)
                pair.ref.extend(joining.ref)
                pair.static.extend(joining.static)
            slots.add(pair.static.shape.slots)
            caps.add(pair.static.shape.capacity)
            assert pair.static.shape.capacity >= (fixed or 64)
            assert pair.static.shape.dynamic_columns is False
            assert pair.static.n_rows <= pair.static.shape.slots
            assert pair.static.valid.shape[1] <= pair.static.shape.capacity
        # one more forward of every row: whatever moved, every row still reads its own columns
        pair.forward([[rnd.randrange(vocab)] for _ in range(pair.ref.n_rows)], 1)
    assert len(slots) > 1 and len(caps) > 1, "the batch moved between buckets"
    assert gathered, "holes were squeezed out"


def _engine(load, arch, drafts, static, batch):
    names, ngram = (DRAFTS | {"none": ([], False)})[drafts]
    return Engine(load(arch), [load(n.format(arch=arch)) for n in names] + [NGRAM] * ngram,
                  batch_size=batch, static_cache=static)


def _decode(engine, params):
    reqs = [EngineRequest(p, None, q, None) for p, q in zip(PROMPTS, params)]
    return {i: out for i, out in engine.generate_many(reqs)}


@pytest.mark.parametrize(("arch", "drafts", "gamma", "batch"), [
    ("llama", "partial", 4, 1), ("llama", "ngram", 1, 3), ("llama", "pool3", 4, 8), ("llama", "self", 4, 3),
    ("gpt2", "pool3", 4, 3), ("gpt2", "partial", 1, 8), ("llama", "none", 4, 3)])
def test_greedy_over_the_static_backend_is_the_target_own(load, arch, drafts, gamma, batch):
    """Rows of different budgets join and leave a batch of ``batch``; each equals the target's
    own greedy decoding, and the static backend decodes what BatchCache decodes."""
    params = [GenerationParams(max_new_tokens=6 + 13 * (i % 4), gamma=gamma, adaptive=False)
              for i in range(len(PROMPTS))]
    static = _decode(_engine(load, arch, drafts, True, batch), params)
    dynamic = _decode(_engine(load, arch, drafts, False, batch), params)
    target = load(arch)
    for i, (p, q) in enumerate(zip(PROMPTS, params)):
        assert static[i].token_ids == target_greedy(target, p, q.max_new_tokens), (i, p)
        assert static[i].token_ids == dynamic[i].token_ids
        assert static[i].stats.accepted_tokens == dynamic[i].stats.accepted_tokens


@pytest.mark.parametrize("batch", [3, 8])
def test_samples_and_seeded_sampling_match_batch_cache(load, batch):
    """``n`` > 1 (rows forked from one prefill), greedy and seeded sampling: the same tokens as
    over BatchCache (sampling is keyed by seed and position, so the same logits give the same draws)."""
    params = [GenerationParams(max_new_tokens=24, gamma=3, adaptive=False, n=1 + i % 3,
                               temperature=0.0 if i % 2 else 0.9, seed=100 + i)
              for i in range(len(PROMPTS))]
    static = _decode(_engine(load, "llama", "pool3", True, batch), params)
    dynamic = _decode(_engine(load, "llama", "pool3", False, batch), params)
    for i in range(len(PROMPTS)):
        for a, b in zip([static[i], *static[i].siblings], [dynamic[i], *dynamic[i].siblings], strict=True):
            assert a.token_ids == b.token_ids, i


def test_shared_prefixes_load_into_the_static_backend(load):
    shared = "You are a helpful assistant. Answer briefly and clearly. " * 3
    prompts = [shared + p for p in PROMPTS[:5]]
    params = GenerationParams(max_new_tokens=12, gamma=4, adaptive=False)
    outs = {}
    for static in (True, False):
        engine = _engine(load, "llama", "partial", static, 3)
        reqs = [EngineRequest(p, None, params, None) for p in prompts]
        outs[static] = dict(engine.generate_many(reqs))
    assert sum(o.stats.cached_prompt_tokens for o in outs[True].values()) > 0
    target = load("llama")
    for i, p in enumerate(prompts):
        assert outs[True][i].token_ids == outs[False][i].token_ids == target_greedy(target, p, 12)


# ------------------------------------------------------------------------------------------------
# compiled shape classes (engine/compile/static.py)


def test_the_memory_budget_counts_the_static_buffers(load, monkeypatch):
    """With the static backend the target's cache is whole buckets of columns in a power of two of
    slots: the budget plans for them, and so caps a batch where BatchCache's estimate would not."""
    monkeypatch.setattr("specbatch.engine.attention._long_tail", 512)
    target = load("llama")
    plain, static = (Engine(target, batch_size=8, static_cache=s, max_memory=10**9)._memory() for s in (False, True))
    assert plain.static_columns is None and static.static_columns is not None
    assert [static.static_columns(c) for c in (10, 200, 700)] == [columns_for(c) for c in (10, 200, 700)]
    kv = plain.shapes[0].kv_bytes_per_token
    for columns in (30, 100, 129, 700):
        held = 2 * columns       # holes: doubled, as for BatchCache
        assert static.row_bytes(columns, 4) - plain.row_bytes(columns, 4) == \
            pytest.approx(kv * (2 * columns_for(held) - 1.25 * held))
    # 100 columns: BatchCache plans 250 a row, the static backend 2 slots' worth of a 256 -> 512 bucket
    budget = int(3 * plain.row_bytes(100, 4))
    plain.budget = static.budget = budget
    assert plain.max_rows(100, 4) == 3 and static.max_rows(100, 4) == 1


def test_classes_compiled_per_device():
    assert static_classes("cpu", 32) == [(1, 1), (2, 1), (4, 1)]
    assert static_classes("cpu", 3, widths=(1, 4)) == [(1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 4)]
    assert static_classes("cuda", 32)[-1] == (32, 1)


def test_a_compile_failure_decodes_eagerly_with_one_warning(load, caplog):
    """A class whose graph fails to compile: one warning, then the same tokens eagerly."""
    target = load("llama")
    graphs = StaticForward(target.model, target.name, target.device, [(1, 1), (2, 1), (4, 1)])

    class Failed(Exception):
        pass

    Failed.__module__ = "torch._inductor.exc"   # what LoadedModel.forward counts as a compiler failure
    calls = []

    def fail(**inputs):
        calls.append(1)
        raise Failed("no C++ compiler")

    graphs._fn = fail
    params = [GenerationParams(max_new_tokens=9 + 5 * i) for i in range(len(PROMPTS))]
    ref = _decode(_engine(load, "llama", "none", True, 4), params)
    engine = _engine(load, "llama", "none", True, 4)
    engine.static_graphs = graphs
    with caplog.at_level("WARNING"):
        out = _decode(engine, params)
    assert {i: o.token_ids for i, o in out.items()} == {i: o.token_ids for i, o in ref.items()}
    assert len(calls) == 1 and graphs.failed and "no C++ compiler" in graphs.failed
    assert sum("decoding eagerly instead" in r.message for r in caplog.records) <= 1


@pytest.fixture(scope="module")
def static_graphs(tiny_models, tmp_path_factory):
    """The tiny target's one-token classes of 1, 2 and 4 slots, compiled (a minute or two)."""
    target = load_model(str(tiny_models / "llama"))
    graphs, report = prepare_static(target, static_classes("cpu", 4), tmp_path_factory.mktemp("static"),
                                    lambda n, g: StaticBatchCache(target, n, g), keep_all=True)
    assert graphs is not None and report.enabled, report.to_dict()
    return target, graphs, report


@pytest.mark.slow   # a minute or two: three classes compiled at static shapes
def test_classes_at_one_fixed_capacity_serve_every_call_that_fits_it(tiny_models, tmp_path, monkeypatch):
    """CUDA's way (``FIXED_COLUMNS``: every size of a graph static) tried on this CPU: the classes
    compiled at 512 columns serve a batch that moves from 128 to 384 columns in use without a
    miss, and decode what the eager backend decodes. (Warmed at one bucket instead, every call at
    another missed on an H200: docs/bench/report-gpu.md.)"""
    monkeypatch.setattr("specbatch.engine.compile.static.FIXED_COLUMNS", {"cpu": 512})
    target = load_model(str(tiny_models / "llama"))
    graphs, report = prepare_static(target, static_classes("cpu", 4), tmp_path,
                                    lambda n, g: StaticBatchCache(target, n, g), keep_all=True)
    assert graphs is not None and report.enabled and graphs.columns == 512, report.to_dict()
    drain_eager_and_compiled(target, graphs)


def drain_eager_and_compiled(target, graphs: StaticForward):
    """A batch of 4 draining to 1 (greedy and seeded-sampled rows) decoded over the static backend
    eagerly and through ``graphs``: the same tokens, every compiled call a warmed graph's. Returns
    (prompts, params, the eager outputs). The last prompt is long: its batch moves from 128 to 384
    columns, a bucket the graphs were not warmed at. Also run on CUDA (tests/engine/test_cuda.py)."""
    prompts = [*PROMPTS, " ".join(PROMPTS) * 2]
    params = [GenerationParams(max_new_tokens=10 + 11 * i, temperature=0.8 * (i % 2), seed=i)
              for i in range(len(prompts))]
    outs = {}
    for g in (None, graphs):
        engine = Engine(target, [], batch_size=4, static_cache=True)
        engine.static_graphs = g
        reqs = [EngineRequest(p, None, q, None) for p, q in zip(prompts, params)]
        outs[g is None] = {i: o.token_ids for i, o in engine.generate_many(reqs)}
    assert outs[True] == outs[False]
    assert graphs.calls > 20 and graphs.misses == 0 and graphs.failed is None
    return prompts, params, outs[True]


@pytest.mark.slow
def test_compiled_classes_decode_what_the_eager_backend_decodes(static_graphs):
    """A batch of 4 draining to 1 runs its one-token steps through the 1-, 2- and 4-slot graphs
    (none missed), greedy and seeded sampling, and decodes the same tokens as eagerly."""
    target, graphs, report = static_graphs
    assert set(report.graphs) == set(report.speedups) == {"1x1:1", "2x1:1", "4x1:1"}
    prompts, params, outs = drain_eager_and_compiled(target, graphs)
    for i, p in enumerate(prompts):
        if not params[i].temperature:
            assert outs[i] == target_greedy(target, p, params[i].max_new_tokens)


def test_compile_static_decodes_over_the_static_backend(tiny_models, tmp_path, monkeypatch):
    """``compile="static"`` (``--compile static``, ``SPECBATCH_COMPILE=static``): the engine's
    batches run over StaticBatchCache with the classes for its batch size compiled."""
    from specbatch.engine.compile import static as S
    from specbatch.engine.compile.record import CompileReport

    asked = []

    def fake(lm, classes, cache_dir, backend, **_):
        asked.append(list(classes))
        return None, CompileReport(model=lm.name, enabled=True)

    monkeypatch.setattr(S, "prepare_static", fake)
    made = []
    monkeypatch.setattr(StaticBatchCache, "__init__", lambda self, *a, init=StaticBatchCache.__init__: (
        made.append(1), init(self, *a))[1])
    engine = Engine.load(str(tiny_models / "llama"), compile="static", cache_dir=str(tmp_path), batch_size=4)
    assert asked == [[(1, 1), (2, 1), (4, 1)]]
    assert engine.static_cache and engine.compile_plan.mode == "static"
    out = engine.generate(prompt=PROMPTS[0], params=GenerationParams(max_new_tokens=8))
    assert made and out.token_ids == target_greedy(engine.target, PROMPTS[0], 8)


def test_where_no_class_pays_the_static_cache_runs_eagerly_and_says_why(monkeypatch, capsys, load, tmp_path):
    from specbatch.cli.compile_text import report_compile
    from specbatch.engine.compile import static as S
    from specbatch.engine.compile.record import CompileReport

    monkeypatch.setattr(S, "prepare_static", lambda lm, *a, **k: (
        None, CompileReport(model=lm.name, enabled=True, speedups={"1x1:1": 0.91}, eager_shapes=["1x1:1"])))
    graphs, plan = S.static_plan(load("llama"), 1, tmp_path, lambda n, g: None)
    assert graphs is None and not plan.enabled and plan.mode == "static"
    report_compile(plan)
    assert "decoding eagerly: static: no class measured faster than eager here (1x1 0.91x)" in capsys.readouterr().err


def test_the_plan_names_only_the_classes_kept_compiled(monkeypatch, load, tmp_path):
    """A worker logged "compiled forward in use from now on (static-cache classes (slots x tokens)
    1x1, 2x1, 4x1, ...)" right after measuring 4x1 at 0.98x and leaving it eager: the plan's reason
    was the classes asked for, before the measurement. It names those that serve, and the others."""
    from types import SimpleNamespace

    from specbatch.engine.compile import static as S
    from specbatch.engine.compile.record import CompileReport

    report = CompileReport(model="llama", enabled=True, speedups={"1x1:1": 1.57, "2x1:1": 1.24, "4x1:1": 0.98},
                           eager_shapes=["4x1:1"])
    monkeypatch.setattr(S, "prepare_static", lambda lm, *a, **k: (SimpleNamespace(classes={(2, 1), (1, 1)}), report))
    graphs, plan = S.static_plan(load("llama"), 4, tmp_path, lambda n, g: None)
    assert graphs is not None and plan.enabled
    assert plan.reason == "static-cache classes (slots x tokens) 1x1, 2x1 compiled; 4x1 stays eager (no faster here)"
