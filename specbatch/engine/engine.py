"""Engine: a target, its draft pool, and the entry points callers use (generate, generate_many)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specbatch.engine.autopilot import AUTO, Autopilot, AutopilotPolicy, BatchSize, check_batch_size
from specbatch.engine.backend import BackendFactory
from specbatch.engine.background import BackgroundCompile
from specbatch.engine.chat import encode
from specbatch.engine.compile.decision import CompilePlan, resolve_mode
from specbatch.engine.compile.forward import StaticForward
from specbatch.engine.compile.prepare import CompileNotice
from specbatch.engine.compile.prepare import declined as compile_declined
from specbatch.engine.compile.prepare import prepare as prepare_compiled
from specbatch.engine.compile.static import static_plan
from specbatch.engine.contention import Contention, Tally, by_slot, describe, governor, watching
from specbatch.engine.decoder import Decoder, Request
from specbatch.engine.drafter_specs import MODEL, DrafterSpec, names, parse_drafters
from specbatch.engine.drafters import Drafter
from specbatch.engine.gamma import CostModel
from specbatch.engine.grammar import GrammarSpec, Matcher, refuse, vocab_for
from specbatch.engine.lanes import deal, run_lanes
from specbatch.engine.loading import LoadedModel, check_same_tokenizer, load_model
from specbatch.engine.memory import (
    MAX_DRAFT,
    MemoryBudget,
    ModelShape,
    default_budget,
    draft_width,
    is_cuda,
    row_columns,
)
from specbatch.engine.model_files import context_problem
from specbatch.engine.policy import MeasuredPolicy, Policy
from specbatch.engine.prefix import PrefixStore
from specbatch.engine.sampling import sample_seed
from specbatch.engine.static_cache import StaticBatchCache, capacity_for
from specbatch.engine.threads import adaptable_threads, configured_lanes, fixed_threads
from specbatch.engine.types import GenerationOutput, GenerationParams
from specbatch.errors import RequestError, SpecBatchError

logger = logging.getLogger(__name__)

AUTO_MAX_BATCH = 256     # the autopilot's ceiling, below whatever the memory budget allows
PREFIX_SHARE = 0.25      # of the memory budget, the most shared prompt prefixes may hold


@dataclass
class _Lane:
    """A decode lane's own state (engine/lanes.py), named as the engine's: the first lane's
    autopilot and step costs are the engine's, a lone decode's memory and prefix store too."""

    costs: dict[int, CostModel] = field(default_factory=dict)
    autopilot: Autopilot | None = None
    memory: MemoryBudget | None = None
    prefixes: PrefixStore | None = None


@dataclass(frozen=True)
class EngineRequest:
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    input_ids: list[int] | None = None


@dataclass(frozen=True)
class Scored:
    """Engine.score: per token, the target's raw log-probability and its probability under the
    request's processors and warp (greedy: 1 for the argmax, else 0)."""

    logprobs: list[float]
    probs: list[float]


def decodable_tokens(budgets: Sequence[int], context: int | None) -> int:
    """What a job's requests can decode: a budget at or past the target's context fails at once
    (prompt + max_new_tokens exceeds it) and decodes nothing, so it must not make auto compile
    for a job that will not decode (one 100,000-token line counted as minutes of decoding)."""
    return sum(n for n in budgets if context is None or n < context)


def sample_rows(requests: Sequence[Request], start: int = 0
                ) -> tuple[list[Request], list[tuple[int, int]], dict[int, int]]:
    """A request with ``n`` samples becomes n decoder rows (parameter ``n``): sample i seeded by
    ``sample_seed(seed, i)`` when the request is seeded. Returns the rows (their index: the
    position in this list), each row's (request index, sample index), and the forks (row ->
    the row of its request's sample 0) that let the samples share one prefill. Row indices begin
    at ``start`` (rows added to a running decode)."""
    rows: list[Request] = []
    owner: list[tuple[int, int]] = []
    forks: dict[int, int] = {}
    for i, ids, params in requests:
        first = start + len(rows)
        for k in range(params.n):
            seed = params.seed if params.seed is None else sample_seed(params.seed, k)
            rows.append((start + len(rows), ids, replace(params, seed=seed, n=1)))
            owner.append((i, k))
            if params.n > 1:
                forks[first + k] = first
    return rows, owner, forks


class Engine:
    """Holds the loaded target and draft models and the step costs measured with them."""

    def __init__(self, target: LoadedModel, drafters: Sequence[LoadedModel | DrafterSpec] = (), *,
                 gamma: int = 4, batch_size: BatchSize = AUTO, max_memory: int | None = None,
                 prefix_cache: bool = True, static_cache: bool = False, lanes: int = 1) -> None:
        """``drafters``: the pool, a loaded model for each draft model (``model:``), a spec for each
        drafter that loads none (``DrafterSpec.parse("ngram")``). ``static_cache``: the target
        decodes over ``StaticBatchCache`` (engine/static_cache.py) instead of ``BatchCache``.
        ``lanes``: decode loops an automatic batch may run at once on a CPU (engine/lanes.py)."""
        if unloaded := [str(d) for d in drafters if isinstance(d, DrafterSpec) and d.loads_model]:
            raise ValueError(f"drafters {unloaded} load a model: pass the loaded model (Engine.load does)")
        # the models in the specs' order (one per name), then the specs, normalized
        self.drafts = list({d.name: d for d in drafters if isinstance(d, LoadedModel)}.values())
        self.specs = parse_drafters(DrafterSpec(MODEL, d.name) if isinstance(d, LoadedModel) else d
                                    for d in drafters)
        for d in self.drafts:
            check_same_tokenizer(target, d)
        self.target = target
        self.gamma = gamma
        self.batch_size = check_batch_size(batch_size)
        self.max_memory = max_memory  # bytes for KV caches + activations; None: a share of free memory
        # measured step costs per batch-size bucket (policy.bucket), shared by every request
        self.costs: dict[int, CostModel] = {}
        self.autopilot: Autopilot | None = None   # kept across calls: what it measured stays true
        self.memory: MemoryBudget | None = None
        self.compile_plan: CompilePlan | None = None  # set by load (compiled forward or not, why)
        self.background: BackgroundCompile | None = None  # a compile still warming up (workers)
        # structured outputs: the grammar's forced tokens are proposed as drafts (off: to measure)
        self.grammar_drafts = True
        # shared prompt prefixes computed once, kept across calls (engine/prefix.py); off: to measure
        self.prefix_cache = prefix_cache
        self.prefixes: PrefixStore | None = None
        self.static_cache = static_cache
        # the static backend's compiled shape classes (``compile="static"``), None: all eager
        self.static_graphs: StaticForward | None = None
        self.lanes = max(1, lanes)
        self.lanes_used = 1     # by the last decode
        # the torch threads one loop decodes on, lowered while other processes hold the cores
        # (engine/contention.py); made at the first decode that may use it
        self.contention: Contention | None = None
        # the governors of processes forked to decode with this engine, one a process slot, summed
        # over the routes that forked again with it (worker/forked.py, contention.by_slot)
        self.forked_contention: list[Tally] = []
        # each lane's own state by (lane, lanes in use), where it is not the attributes above
        self.lane_state: dict[tuple[int, int], _Lane] = {}

    @classmethod
    def load(cls, target: str, drafters: Sequence[str | DrafterSpec] = (), *,
             device: str = "cpu", dtype: str = "float32", cache_dir: str | None = None,
             trust_remote_code: bool = False, gamma: int = 4, batch_size: BatchSize = AUTO,
             max_memory: int | None = None, compile: str = "off", prefix_cache: bool = True,
             expected_new_tokens: int | Sequence[int] | None = None,
             notify: Callable[[CompileNotice], None] | None = None,
             background: Callable[[str], None] | bool = False, lanes: int | None = None,
             linears: str = "auto") -> Engine:
        """Load the target and the pool's draft models (``drafters``: spec strings or specs,
        ``specbatch.engine.drafter_specs``; ModelLoadError for one not available); ``compile``
        (auto / on / off; static: the target decodes over ``StaticBatchCache`` with its
        small-row classes compiled, engine/compile/static.py) compiles them before returning (``expected_new_tokens``: the job's size,
        for auto, as a total or one budget per request; None means a long-lived worker; ``notify``: told before each model compiles, see
        ``compile.prepare``). With batch_size "auto" the compile decision plans for
        ``planned_batch_size()`` rows. ``background`` (a worker): return eager at once and
        compile in a thread instead (``specbatch.engine.background``; a callable hears its state),
        switching to the compiled forward between batches once it is warmed up and faster.
        ``lanes``: None, those ``threads.configure_threads`` chose for this process. ``linears``:
        how float32 CPU Linears multiply (``packed.kernel``: SPECBATCH_LINEARS, from the caller)."""
        kw: dict[str, Any] = {"device": device, "dtype": dtype, "cache_dir": cache_dir,
              "trust_remote_code": trust_remote_code, "linears": linears}
        specs = parse_drafters(drafters)
        mode, cache = resolve_mode(compile), str(cache_dir or "")    # (a bad mode: before any load)
        if mode != "off" and not cache:
            raise ValueError(f"compile={compile!r} needs cache_dir: the compiled graphs and their records live there")
        t = load_model(target, **kw)
        # a draft of the target's own weights (the default pair) is quantized from them in memory
        engine = cls(t, [load_model(s.arg, **kw, loaded=[t]) if s.loads_model else s for s in specs], gamma=gamma,
                     batch_size=batch_size, max_memory=max_memory, prefix_cache=prefix_cache,
                     lanes=configured_lanes() if lanes is None else lanes)
        if expected_new_tokens is not None and not isinstance(expected_new_tokens, int):
            expected_new_tokens = decodable_tokens(expected_new_tokens, t.max_positions)
        if mode == "static":
            engine.static_cache = True
            rows = engine.batch_size if isinstance(engine.batch_size, int) else 64
            backend = lambda n, g: StaticBatchCache(t, n, g)   # noqa: E731
            if background is not False:   # (the static backend eagerly until its classes are warm)
                engine.compile_plan = CompilePlan(mode, False, "compiling the static-cache classes in the "
                                                  "background, decoding eagerly until then")
                engine.background = BackgroundCompile(
                    t, [], mode=mode, batch_size=rows, cache_dir=cache, static_backend=backend,
                    on_state=background if callable(background) else None).start()
                return engine
            engine.static_graphs, engine.compile_plan = static_plan(t, rows, cache, backend, notify=notify)
            return engine
        if background is not False and mode != "off":
            declined = compile_declined(t, engine.drafts, mode=mode, batch_size=engine.planned_batch_size(),
                                        cache_dir=cache)
            if declined is not None:   # nothing to compile: no thread, and the state says why at once
                engine.compile_plan = declined
                if callable(background):
                    background(f"eager: {declined.reason}")
                return engine
            engine.compile_plan = CompilePlan(mode, False, "compiling in the background, decoding eagerly until then")
            engine.background = BackgroundCompile(
                t, engine.drafts, mode=mode, batch_size=engine.planned_batch_size(), cache_dir=cache,
                on_state=background if callable(background) else None).start()
            return engine
        engine.compile_plan = prepare_compiled(
            t, engine.drafts, mode=mode, batch_size=engine.planned_batch_size(),
            cache_dir=cache, expected_new_tokens=expected_new_tokens, notify=notify)
        return engine

    def adopt_compiled(self) -> bool:
        """Switch to the compiled forward a background compile finished (between batches, on the
        decoding thread); True when this call switched. The step costs, the autopilot's rates and
        the memory budget measured eager code and less free memory: they start over."""
        background = self.background
        if background is None or not background.done:
            return False
        self.background = None            # finished: nothing more to adopt, no memory to leave it
        plan = background.adopt()
        self.compile_plan, self.memory = background.plan, None
        if plan is None:
            return False
        if background.graphs is not None:
            self.static_graphs = background.graphs
        self.costs, self.autopilot = {}, None
        return True

    @property
    def target_name(self) -> str:
        return self.target.name

    @property
    def drafter_names(self) -> list[str]:
        return names(self.specs)

    def new_drafters(self) -> list[Drafter]:
        """A fresh pool for one decode, built by the registry: its members keep per-row state for
        that batch."""
        models = iter(self.drafts)
        return [s.build(next(models) if s.loads_model else None, self.target.vocab_size) for s in self.specs]

    def encode(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> list[int]:
        """A prompt is tokenized as is; messages go through the target's chat template."""
        return encode(self.target.tokenizer, self.target.name, prompt, messages)

    def _ids(self, prompt: str | None, messages: list[dict[str, Any]] | None,
             input_ids: list[int] | None) -> list[int]:
        if input_ids is None:
            return self.encode(prompt, messages)
        if not input_ids or not all(isinstance(i, int) for i in input_ids):
            raise RequestError("must be a non-empty list of integers", field="input_ids")
        return list(input_ids)

    def _check_fits(self, ids: list[int], params: GenerationParams) -> None:
        vocab = self.target.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise RequestError(f"token ids must be in [0, {vocab})", field="input_ids")
        # a draft with a shorter context than the target bounds what the pair can generate
        for m in (self.target, *self.drafts):
            if problem := context_problem(len(ids), params.max_new_tokens, m.name, m.max_positions):
                raise RequestError(problem, field="max_new_tokens")

    def generate(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                 params: GenerationParams | None = None, *,
                 input_ids: list[int] | None = None) -> GenerationOutput:
        """Decode one request (a batch of one); raises RequestError when the request is invalid."""
        req = EngineRequest(prompt, messages, params or GenerationParams(), input_ids)
        for _, out in self.generate_many([req], batch_size=1):
            if isinstance(out, SpecBatchError):
                raise out
            return out
        raise AssertionError("generate_many yields one result per request")

    def generate_many(self, requests: Sequence[EngineRequest], batch_size: BatchSize | None = None, *,
                      policy: Policy | None = None, on_start: Callable[[list[int]], None] | None = None,
                      more: Callable[[int], Sequence[EngineRequest]] | None = None
                      ) -> Iterator[tuple[int, GenerationOutput | SpecBatchError]]:
        """Yield (index, output or the request's own error) as each request finishes.

        Up to ``batch_size`` requests decode together (continuous batching); "auto" lets the
        throughput autopilot choose the batch size and whether to speculate by measurement
        (``specbatch.engine.autopilot``); ``policy`` replaces either. ``on_start(indices)``:
        called as requests start decoding (join the batch), before any forward over them.
        ``more(room)``: up to ``room`` more requests, asked while the batch has free places and
        nothing waits (``Decoder.run``'s refill: a worker claims more of its job); their indices
        follow those of ``requests`` in the order given. It returns none when there are none.
        """
        self.adopt_compiled()
        size = check_batch_size(batch_size or self.batch_size)
        refused: list[tuple[int, SpecBatchError]] = []
        valid = self._valid(requests, 0, refused)
        yield from refused
        refused.clear()
        rows, owner, forks = sample_rows(valid)
        lanes = self.lanes_used = self._lanes_for(size, policy, valid)
        decoders = [Decoder(self.target, self.new_drafters(), policy or self._policy(size, rows, k, lanes),
                            default_gamma=self.gamma, memory=self._memory(k, lanes),
                            grammar_drafts=self.grammar_drafts, prefixes=self._prefix_store(k, lanes),
                            backend=self._backend(), contention=self._contention(lanes)) for k in range(lanes)]
        started: set[int] = set()

        def start(flat: list[int]) -> None:      # the caller hears of each request once
            fresh = list(dict.fromkeys(owner[f][0] for f in flat if owner[f][0] not in started))
            started.update(fresh)
            if fresh and on_start is not None:
                on_start(fresh)

        samples: dict[int, dict[int, GenerationOutput]] = {}
        wanted = {i: p.n for i, _, p in valid}
        given = len(requests)

        def refill_for(decoder: Decoder) -> Callable[[int], list[Request]]:
            def refill(room: int) -> list[Request]:
                nonlocal given
                assert more is not None
                extra = list(more(room))
                fresh = self._valid(extra, given, refused)
                given += len(extra)
                new_rows, new_owner, new_forks = sample_rows(fresh, start=len(owner))
                owner.extend(new_owner)
                decoder.forks.update(new_forks)
                wanted.update((i, p.n) for i, _, p in fresh)
                return new_rows
            return refill

        # (without ``more``, the decoder asks no one)
        if lanes == 1:
            decoded = decoders[0].run(rows, start, forks=forks,
                                      refill=refill_for(decoders[0]) if more is not None else None)
        else:
            decoded = run_lanes(decoders, deal(self._lane_groups(rows, forks), lanes), start, forks,
                                refill_for if more is not None else None)
        with torch.inference_mode():
            for f, out in decoded:
                yield from refused
                refused.clear()
                i, k = owner[f]
                out.sample_index = k
                got = samples.setdefault(i, {})
                got[k] = out
                if len(got) == wanted[i]:     # a request is done when all its samples are
                    first, *rest = (got[j] for j in range(wanted[i]))
                    first.siblings = rest
                    del samples[i]
                    yield i, first
        yield from refused

    def _backend(self) -> BackendFactory | None:
        """The target's backend: None (the decoder's default ``BatchCache``) or the static one."""
        if not self.static_cache:
            return None
        target, graphs = self.target, self.static_graphs
        return lambda n: StaticBatchCache(target, n, graphs)

    def _valid(self, requests: Sequence[EngineRequest], start: int,
               refused: list[tuple[int, SpecBatchError]]) -> list[Request]:
        """The requests that can decode, as (index from ``start``, prompt ids, params); the others'
        own errors go to ``refused``."""
        valid: list[Request] = []
        for i, req in enumerate(requests, start=start):
            try:
                params = req.params.validate(self.target.vocab_size)
                ids = self._ids(req.prompt, req.messages, req.input_ids)
                self._check_fits(ids, params)
            except SpecBatchError as e:
                refused.append((i, e))
                continue
            valid.append((i, ids, params))
        return valid

    def score(self, tokens: Sequence[int], prompt: str | None = None,
              messages: list[dict[str, Any]] | None = None, *, input_ids: list[int] | None = None,
              params: GenerationParams | None = None) -> Scored:
        """The target alone on ``tokens`` following the prompt, in one forward (teacher forcing):
        each token's raw log-probability, and its probability under ``params``' grammar mask,
        processors and warp, in a decode step's order (what sampling could draw). For audits
        (specbatch.jobs.audit)."""
        from specbatch.engine.processors import RowProcessors
        from specbatch.engine.sampling import Warp

        params = (params or GenerationParams()).validate(self.target.vocab_size)
        ids = self._ids(prompt, messages, input_ids)
        toks = [int(t) for t in tokens]
        if not toks:
            return Scored([], [])
        with torch.inference_mode():
            seq = torch.tensor([ids + toks], device=self.target.device)
            logits = self.target.model(seq).logits[0, len(ids) - 1: -1].float()      # (n, V)
            at = torch.tensor(toks, device=logits.device)[:, None]
            raw = logits.log_softmax(-1).gather(1, at)[:, 0].tolist()
            if params.structured is not None:     # then processors and warp: a decode step's order
                self._mask_by_grammar(logits, toks, params.structured)
            procs = RowProcessors.build(params, len(ids))
            x = logits if procs is None else procs(logits, ids, [toks[:j] for j in range(len(toks))])
            if params.greedy:
                probs = (x.argmax(-1) == at[:, 0]).float().tolist()
            else:
                warp = Warp(params.temperature, params.top_k, params.top_p, params.min_p)
                probs = warp.probs(x).gather(1, at)[:, 0].tolist()
        return Scored(raw, probs)

    def _mask_by_grammar(self, logits: torch.Tensor, tokens: list[int], spec: GrammarSpec) -> None:
        """logits (n, V) in place: position j masked by the grammar state after tokens[:j], as the
        decoder masks p. Past a token the grammar refuses nothing is masked: that token's
        probability is already 0, which is what an audit reports."""
        t = self.target
        m = Matcher(vocab_for(t.tokenizer, t.vocab_size, tuple(sorted(t.eos_token_ids))), spec)
        for j, token in enumerate(tokens):
            refuse(logits[j], m.mask())
            if not m.advance([token]):
                break

    @property
    def speculates(self) -> bool:
        return bool(self.specs)

    def _memory(self, lane: int = 0, lanes: int = 1) -> MemoryBudget:
        """The memory budget of one decode (``lanes`` > 1: lane ``lane``'s share of it)."""
        owner = self if lanes == 1 else self._lane(lane, lanes)
        if owner.memory is None:
            owner.memory = self._new_memory(lanes)
        return owner.memory

    def _new_memory(self, lanes: int) -> MemoryBudget:
        budget = self.max_memory or default_budget(self.target.device)
        if self.max_memory is None and self.background is not None and not self.background.done:
            # what the compile running beside decoding will add (reset once it is adopted)
            budget = max(budget - self.background.reserved_bytes(), budget // 2)
        shapes = tuple(ModelShape.of(m.model) for m in (self.target, *self.drafts))
        graphs = self.static_graphs
        return MemoryBudget(budget // lanes, shapes, high_water=not is_cuda(self.target.device),
                            static_columns=(lambda c: capacity_for(c, graphs)) if self.static_cache else None)

    def _prefix_store(self, lane: int = 0, lanes: int = 1) -> PrefixStore | None:
        """The worker's shared prompt prefixes, within a share of the memory budget (which
        then leaves the rows what the store holds: ``MemoryBudget.reserved``); a lane's own."""
        if not self.prefix_cache:
            return None
        memory = self._memory(lane, lanes)
        owner = self if lanes == 1 else self._lane(lane, lanes)
        if owner.prefixes is None:
            owner.prefixes = PrefixStore(int(memory.budget * PREFIX_SHARE))
        memory.reserved = owner.prefixes.nbytes
        return owner.prefixes

    def _policy(self, size: BatchSize, valid: list[Request], lane: int = 0, lanes: int = 1) -> Policy:
        if size != AUTO:
            return MeasuredPolicy(int(size), self.costs)
        # the search's ceiling: rows of the median request that fit (admission checks each one)
        cols = sorted(row_columns(len(ids), p, self.gamma) for _, ids, p in valid) or [1]
        width = max((draft_width(p, self.gamma) for _, _, p in valid), default=MAX_DRAFT)
        cap = min(AUTO_MAX_BATCH, self._memory(lane, lanes).max_rows(cols[len(cols) // 2], width))
        # the first lane's autopilot is the engine's: what it reports
        owner = self if lane == 0 else self._lane(lane, lanes)
        if owner.autopilot is None:
            owner.autopilot = Autopilot(cap=cap, speculation=self.speculates)
        owner.autopilot.cap = cap
        return AutopilotPolicy(cap, owner.costs, pilot=owner.autopilot)

    def _contention(self, lanes: int) -> Contention | None:
        """The threads' governor of an eager CPU loop whose threads are the default (one loop:
        lanes share the process's threads), once the target's logits agree on every count; of
        threads the user fixed, one that only watches (``contention.watching``)."""
        if self.contention is None and lanes == 1 and self._eager() and str(self.target.device).split(":")[0] == "cpu":
            if full := adaptable_threads():
                self.contention = governor(self.target, full)
            elif fixed := fixed_threads():
                self.contention = watching(fixed)
        return self.contention if lanes == 1 else None

    def _eager(self) -> bool:
        """No compiled forward: none planned, none warming up, none serving the target (one that
        failed decodes eagerly for good)."""
        planned = self.compile_plan is not None and self.compile_plan.enabled
        return not self.static_cache and self.background is None and not self.target.compiled_live and \
            not (planned and self.target.compiled is None)

    def _lane(self, lane: int, lanes: int) -> _Lane:
        return self.lane_state.setdefault((lane, lanes), _Lane())

    def _lanes_for(self, size: BatchSize, policy: Policy | None, valid: list[Request]) -> int:
        """Lanes this decode runs: the engine's, for an automatic batch of eager CPU decoding
        (a compiled graph is not called from two threads; a fixed batch size means that many
        rows), at most one a request; else 1."""
        if self.lanes == 1 or size != AUTO or policy is not None or not self._eager() or \
                str(self.target.device).split(":")[0] != "cpu":
            return 1
        return max(1, min(self.lanes, len(valid)))

    @staticmethod
    def _lane_groups(rows: list[Request], forks: Mapping[int, int]) -> list[list[Request]]:
        """Rows that must decode in one lane: a request's samples (they fork from one prefill)."""
        groups: dict[int, list[Request]] = {}
        for row in rows:
            groups.setdefault(forks.get(row[0], row[0]), []).append(row)
        return list(groups.values())

    def rows_now(self) -> int | None:
        """Rows decoding keeps now: the autopilot's kept size once it decoded, else a fixed
        batch size; None while automatic and nothing decoded yet (what the worker's gauge shows
        and its claims follow)."""
        if self.autopilot is not None:      # (with lanes: the rows of every lane of the last decode)
            lanes = [st.autopilot for (k, n), st in self.lane_state.items() if n == self.lanes_used and k and st.autopilot]
            return self.autopilot.kept[0] + sum(p.kept[0] for p in lanes)
        return None if self.batch_size == AUTO else int(self.batch_size)

    def speculating_now(self) -> bool:
        """Whether decoding drafts now: the autopilot's kept choice once it decoded, else
        whether there are drafters."""
        return self.autopilot.kept[1] if self.autopilot is not None else self.speculates

    def planned_batch_size(self) -> int:
        """Rows a compile decision made before decoding plans for: a fixed size, or the
        autopilot's kept size once measured (not merely chosen), else 8 within its cap."""
        if self.batch_size != AUTO:
            return int(self.batch_size)
        return self.autopilot.planned_rows() if self.autopilot is not None else 8

    def contention_line(self) -> str | None:
        """The run-end line of what the thread governors did over this engine's decodes, here
        and in the processes forked with it; None where the cores were never taken."""
        own = [self.contention.tally()] if self.contention is not None else []
        # (this process, where it decoded a route itself, is one of the processes at a time)
        return describe(by_slot(own, self.forked_contention))

    def batch_report(self) -> dict[str, Any] | None:
        """What the autopilot chose and measured so far (None before an automatic batch ran)."""
        if self.autopilot is None:
            return None
        return {**self.autopilot.summary(), "lanes": self.lanes_used}
