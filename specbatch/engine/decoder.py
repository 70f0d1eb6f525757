"""The decode loop: every request, alone or among others, is a row of one batched loop.

Each step every row drafts (each pool member proposes up to the row's gamma), the row's
proposals become its token tree, and one target forward scores every row's tree (a 4-D mask: a
node sees its row's valid cache and its own ancestors). Each row then accepts its own number of
tokens; rejected nodes become holes in the batch KV caches (``BatchCache``), so no row waits for
another and rollback is per row. Finished rows leave the batch and waiting requests join it.
Greedy rows equal the target's own greedy decoding; sampled rows the target's own sample with
the row's noise (the exponential race keyed by output position, engine/sampling.py).
Prompt prefixes that requests share are computed once and copied into each joining row, which
then prefills only the rest of its prompt (engine/prefix.py).

Call ``Decoder.run`` under ``torch.inference_mode()``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from specbatch.engine import clock, constrained
from specbatch.engine.backend import BackendFactory, TargetBackend, joining
from specbatch.engine.cache import BatchCache
from specbatch.engine.contention import Contention
from specbatch.engine.drafters import Drafter, Proposal, common_prefix
from specbatch.engine.gamma import GammaController
from specbatch.engine.grammar import Matcher, vocab_for
from specbatch.engine.loading import LoadedModel
from specbatch.engine.memory import MAX_DRAFT, MemoryBudget, draft_width, measure, row_columns
from specbatch.engine.policy import Policy, StepReport
from specbatch.engine.prefill import feed_lengths, length_runs, prefilled
from specbatch.engine.prefix import PrefixEntry, PrefixStore, shared_prefixes
from specbatch.engine.processors import RowProcessors
from specbatch.engine.sampling import RowNoise, Verdict, Warp
from specbatch.engine.stopping import StopCheck
from specbatch.engine.tally import Tally
from specbatch.engine.token_bytes import TokenBytes
from specbatch.engine.tree import TokenTree, build_tree, verify_greedy, verify_race
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats, TokenLogprob

# Grammar masks are computed on this helper thread while the target's forward runs (torch's kernels
# release the GIL; llguidance computes a mask without it): off the step's critical path. The thread
# starts at the first structured step of the process (after a Celery fork, in the child).
_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specbatch-grammar-masks")

Request = tuple[int, list[int], GenerationParams]   # (caller's index, prompt ids, parameters)


def longest_first(requests: Iterable[Request]) -> list[Request]:
    """Admission order: longest ``max_new_tokens`` first, a stable sort (a request's samples stay
    together). The rows that decode longest start first and the short ones take the places that
    free up, so a batch drains later and for fewer steps (docs/DESIGN.md, "Admission order")."""
    return sorted(requests, key=lambda r: -r[2].max_new_tokens)


@dataclass
class Row:
    """One request being decoded."""

    index: int
    ids: list[int]                      # prompt + generated (the accepted sequence)
    params: GenerationParams
    stop: StopCheck
    warp: Warp | None                   # None: greedy
    noise: RowNoise | None              # sampled rows: keyed by (seed, position), not by the batch or drafting
    procs: RowProcessors | None         # logit processors (penalties, logit_bias); None: none
    ctl: GammaController
    tally: Tally
    t_start: float
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[TokenLogprob] | None = None   # per generated token, when params.logprobs is set
    grammar: Matcher | None = None      # structured output: the state after ``generated``


class Decoder:
    """Decodes requests with a target and a draft pool, as many at a time as the policy allows."""

    def __init__(self, target: LoadedModel, drafters: Sequence[Drafter], policy: Policy,
                 default_gamma: int = 4, memory: MemoryBudget | None = None,
                 backend: BackendFactory | None = None, grammar_drafts: bool = True,
                 prefixes: PrefixStore | None = None, contention: Contention | None = None) -> None:
        """``target`` gives the tokenizer, stop ids and device; ``backend`` runs it (default: the
        transformers model itself over a ``BatchCache``; see engine/backend.py). ``prefixes``:
        where shared prompt prefixes are kept across decodes (None: every row prefills its whole
        prompt). ``contention``: told each step's wall and CPU time, it sets the torch threads
        (engine/contention.py; None: they stay)."""
        self.target, self.drafters, self.policy = target, list(drafters), policy
        self.grammar_drafts = grammar_drafts   # structured rows: the grammar's forced tokens as a draft chain
        self.default_gamma = default_gamma
        self.memory = memory
        self.rows: list[Row] = []
        self.forks: dict[int, int] = {}     # run's: caller index -> the request whose prompt it has
        self.backend: BackendFactory = backend or (lambda n: BatchCache(target, n))
        self.cache: TargetBackend = self.backend(0)
        # drafters that read the target's hidden states (EAGLE-style) get them on the accepted path
        self.hidden = any(d.needs_target_hidden for d in self.drafters)
        self.token_bytes = TokenBytes(target.tokenizer)    # for logprobs' ``bytes``
        # the draft models' caches lag the rows: rows joined, or steps ran, without drafting
        # (their first proposal then feeds the backlog: a catch-up, not a measured step)
        self.drafts_behind = False
        self.prefixes = prefixes
        self.contention = contention
        self.pool = (target.name, *(d.name for d in self.drafters))   # a stored prefix's owner
        self.shared: dict[int, int] = {}    # request index -> length of a prefix others share
        self.known: set[tuple[int, ...]] = set()   # those prefixes (refilled requests read them too)

    def run(self, requests: Iterable[Request], on_start: Callable[[list[int]], None] | None = None,
            *, forks: Mapping[int, int] | None = None,
            refill: Callable[[int], list[Request]] | None = None,
            halt: threading.Event | None = None) -> Iterator[tuple[int, GenerationOutput]]:
        """Yield (index, output) as each request finishes.

        ``on_start(indices)`` is called as requests join the batch, before any forward over them:
        a worker charges a request's attempt there, not when it only waits in the queue.

        ``forks[i] = j``: request i has request j's prompt (samples of one request, parameter
        ``n``); those that join the batch together cache the prompt once and fork from it.

        When the policy allows fewer rows than are active (the throughput autopilot lowering the
        batch size) the newest rows pause: they leave the caches with their state and resume
        later, their context cached again. A row joins only if the memory budget holds it.

        ``refill(room)``: asked for up to ``room`` more requests when nothing waits and at least a
        quarter of the batch's places are free, once more when the batch has emptied (a worker
        claims more of its job there), so a batch stays full until the work runs out instead of
        draining at the end of every claim. Its requests' samples must be in ``self.forks`` by
        then (the caller adds them).

        ``halt``: once set, the run ends before its next step, its rows dropped (engine/lanes.py:
        the other lanes of a failed or closed run).
        """
        waiting = deque(longest_first(requests))
        self.forks = dict(forks or {})
        if self.prefixes is not None:
            # a request counts once in the trie: its samples (forks) have its prompt, and
            # prefill it once anyway (they fork from one), so they take its length, not a
            # prefix of their own that n copies of one prompt would seem to share
            own = [r for r in waiting if self.forks.get(r[0], r[0]) == r[0]]
            by_request = dict(zip((i for i, _, _ in own), shared_prefixes([ids for _, ids, _ in own])))
            lengths = [by_request.get(self.forks.get(i, i), 0) for i, _, _ in waiting]
            self.shared = {i: n for (i, _, _), n in zip(waiting, lengths) if n}
            # rows sharing a prefix join together (each group where its first request was)
            groups: dict[object, list[Request]] = {}
            for req, n in zip(waiting, lengths):
                groups.setdefault(tuple(req[1][:n]) if n else req[0], []).append(req)
            waiting = deque(r for g in groups.values() for r in g)
            self.known = {tuple(ids[:self.shared[i]]) for i, ids, _ in waiting if i in self.shared}
        paused: deque[Row] = deque()
        if self.memory is not None:
            self.memory.check(measure(self.target.device), 0, 0, 0)   # the baseline
        while halt is None or not halt.is_set():
            limit = max(1, self.policy.max_rows(len(waiting) + len(paused)))
            if len(self.rows) > limit:
                paused.extendleft(reversed(self._pause(len(self.rows) - limit)))
            room = limit - len(self.rows)
            if refill is not None and not waiting and not paused and room >= max(1, limit // 4):
                waiting.extend(self._refilled(refill(room)))
            if not (waiting or paused or self.rows):
                break
            resuming, joining = self._admissible(limit, waiting, paused)
            if resuming or joining:
                if joining and on_start is not None:
                    on_start([i for i, _, _ in joining])
                self._admit(joining, resuming)
            else:
                self._step()
            yield from self._retire()

    def _refilled(self, requests: list[Request]) -> list[Request]:
        """Refilled requests in admission order, each reading the longest shared prefix the
        first requests found that its prompt starts with (no new trie: the prefixes of a job's
        first claim are its system prompts, and a request of a later claim has the same)."""
        for i, ids, _ in requests:
            n = max((len(p) for p in self.known if len(p) < len(ids) and tuple(ids[:len(p)]) == p), default=0)
            if n:
                self.shared[i] = n
        return longest_first(requests)

    def _admissible(self, limit: int, waiting: deque[Request], paused: deque[Row]
                    ) -> tuple[list[Row], list[Request]]:
        """Paused rows first, then waiting requests, up to ``limit`` rows within the memory budget
        (alone, a request always runs: one too long for the budget waits for a smaller batch)."""
        resuming: list[Row] = []
        joining: list[Request] = []
        cols = max((self._columns(r) for r in self.rows), default=0)
        width = max((draft_width(r.params, self.default_gamma) for r in self.rows), default=MAX_DRAFT)
        # the prefixes the joining rows compute are stored before the rows run: count them now
        # (up to the store's budget: it evicts to make room)
        computing: set[tuple[int, ...]] = set()
        reserving = 0
        while len(self.rows) + len(resuming) + len(joining) < limit and (paused or waiting):
            need = self._columns(paused[0]) if paused \
                else row_columns(len(waiting[0][1]), waiting[0][2], self.default_gamma)
            wide = draft_width(paused[0].params if paused else waiting[0][2], self.default_gamma)
            n = len(self.rows) + len(resuming) + len(joining) + 1
            key = self._new_prefix(waiting[0]) if not paused else None
            more = reserving
            if key is not None and key not in computing and self.memory is not None and self.prefixes is not None:
                more = min(reserving + len(key) * self.memory.kv_bytes_per_token,
                           max(0, self.prefixes.budget - self.memory.reserved))
            if self.memory is not None and not self.memory.fits(n, max(cols, need), max(width, wide), more):
                break
            if key is not None:
                computing.add(key)
            cols, width, reserving = max(cols, need), max(width, wide), more
            if paused:
                resuming.append(paused.popleft())
            else:
                joining.append(waiting.popleft())
        return resuming, joining

    def _new_prefix(self, req: Request) -> tuple[int, ...] | None:
        """The shared prefix ``req`` would compute on joining (one not stored yet), or None."""
        n = self.shared.get(req[0], 0)
        if not n or self.prefixes is None or self.prefixes.holds(req[1][:n], self.pool):
            return None
        return tuple(req[1][:n])

    def _pause(self, n: int) -> list[Row]:
        """The ``n`` rows that started last leave the batch with their state (they resume later)."""
        newest = set(sorted(range(len(self.rows)), key=lambda i: self.rows[i].t_start)[len(self.rows) - n:])
        staying = [i for i in range(len(self.rows)) if i not in newest]
        out = [r for i, r in enumerate(self.rows) if i in newest]
        self.rows = [self.rows[i] for i in staying]
        self.cache.select(staying)
        for d in self.drafters:
            d.retire(staying)
        return out

    # -- admission: a fresh batch caches its prompts in its first step (unless they would pad
    #    it: then as joining rows do); rows joining a running batch cache theirs (all but the
    #    last token) in forwards of their own, rows of similar length together, then merge
    #    (resumed rows alike: their ids are prompt + what they generated so far)
    def _admit(self, arrivals: list[Request], resuming: Sequence[Row] = ()) -> None:
        now = time.perf_counter()
        new = [self._new_row(i, ids, p, now) for i, ids, p in arrivals] + list(resuming)
        # where the policy decodes plainly now (a large CPU batch) the drafts would cache and load
        # for nothing: they skip this admission, and a later proposal catches their rows up
        speculating = self.policy.gamma_cap(len(self.rows) + len(new)) != 0 \
            or any(r.ctl.fixed and r.ctl.gamma for r in (*self.rows, *new))   # (fixed rows draft anyway)
        new, entries = self._prefixes(new, len(arrivals), speculating)
        # (a prefix computed just now is its computing row's: _prefixes)
        t0 = clock.now(self.target.device)
        # samples of one request joining together: one prefill (after their shared prefix, if
        # one is stored), forked to their rows
        resumed = {id(r) for r in resuming}
        keys = [None if id(r) in resumed else self.forks.get(r.index, r.index) for r in new]
        # the distinct prompts shortest first, each request's samples after it: the prefill
        # runs over rows of similar length (engine/prefill.py), not one forward padded to the longest
        new, entries, keys = _by_length(new, entries, keys)
        src = _fork_sources(keys)
        reps = [src.index(u) for u in range(max(src, default=-1) + 1)]
        shared = len(reps) < len(src)
        prefixes = [None if (e := entries[b]) is None else e.kv[0] for b in reps]
        fed = feed_lengths([new[b].ids for b in reps], prefixes)
        runs = length_runs(fed)
        # (a fresh batch caches each row's prompt in its first step, unless pads would waste it)
        prefill = bool(self.rows) or shared or len(runs) > 1
        forwards = 0
        if prefill:
            # (the governor reads each forward: engine/prefill.forward_in_runs)
            cache, forwards = prefilled(self.backend, prefixes, [new[b].ids for b in reps], runs,
                                        None if self.contention is None else self.contention.observe)
        else:
            cache = joining(self.backend, prefixes)
        if shared:
            cache.fork(src)
        self.cache.extend(cache)
        draft_prefill = prefill and speculating
        draft_forwards = sum(d.admit(new, draft_prefill, [e.kv[j + 1] if e is not None and speculating else None
                                                          for e in entries])
                             for j, d in enumerate(self.drafters))
        self.drafts_behind |= prefill and not draft_prefill
        if forwards:    # (the samples of a request each count the prefill they share)
            seconds = clock.now(self.target.device) - t0
            if self.prefixes is not None:     # a prefill's rate: what a cached token saves
                self.prefixes.observe(seconds, sum(fed))
            if not self.rows:   # a fresh batch's prompts, which its first step caches otherwise:
                # the policy learns what a prefill costs (the autopilot prices a draft's catch-up so)
                self.policy.observe(StepReport(len(new), 0, 0, 0, 0.0, seconds, True))
            for r in new:   # (the prefill's time is the job's time too)
                r.tally.prefill(seconds, draft_forwards)
                r.tally.batch_share(len(self.rows) + len(new), seconds / len(new))
        self.rows.extend(new)

    def _prefixes(self, new: list[Row], n_joining: int, drafts: bool
                  ) -> tuple[list[Row], list[PrefixEntry | None]]:
        """Each row's longest stored prefix, or the prefix it shares with other requests of
        this decode, computed now; rows sharing one made adjacent (``joining`` loads each run
        once). The first ``n_joining`` rows are new: their statistics count what was cached."""
        store = self.prefixes
        if store is None:
            return new, [None] * len(new)
        made: dict[tuple[int, ...], PrefixEntry] = {}
        found: list[PrefixEntry | None] = []
        for b, r in enumerate(new):
            limit = len(r.ids) - 1           # the last token is fed by the step that scores it
            entry = store.longest(r.ids, self.pool, limit)
            want = self.shared.pop(r.index, 0) if b < n_joining else 0
            cached = entry is not None
            if want and (entry is None or len(entry.tokens) < want):
                entry = made.get(tuple(r.ids[:want]))
                cached = entry is not None
                if entry is None:
                    entry = made[tuple(r.ids[:want])] = self._compute_prefix(r.ids[:want], drafts)
                    store.observe(entry.seconds, len(entry.tokens))
                    r.tally.prefill(entry.seconds, sum(k is not None for k in entry.kv[1:]))
                    r.tally.batch_share(1, entry.seconds)     # a forward of one row
                    store.put(entry)
                    if self.memory is not None:
                        self.memory.reserved = store.nbytes
            if entry is not None and cached and b < n_joining:
                r.tally.cached(len(entry.tokens))
            found.append(entry)
        groups: dict[int, list[int]] = {}
        for b, e in enumerate(found):
            groups.setdefault(id(e), []).append(b)
        order = [b for bs in groups.values() for b in bs]
        return [new[b] for b in order], [found[b] for b in order]

    def _compute_prefix(self, tokens: list[int], drafts: bool) -> PrefixEntry:
        """A prefix's KV for the target and (``drafts``) every drafter, each computed alone in one
        forward; a drafter without one feeds the whole prompt when its rows speculate."""
        t0 = clock.now(self.target.device)
        alone = self.backend(1)
        alone.forward([tokens], logits_to_keep=1)
        kv = (alone.export_prefix(), *(d.prefix(tokens) if drafts else None for d in self.drafters))
        return PrefixEntry(tuple(tokens), kv, self.pool, clock.now(self.target.device) - t0)

    def _new_row(self, index: int, ids: list[int], params: GenerationParams, now: float) -> Row:
        warp = None if params.greedy else Warp(params.temperature, params.top_k, params.top_p, params.min_p)
        noise = None
        if warp is not None:   # (an unseeded request: a random row seed, drawn once)
            noise = RowNoise(params.seed if params.seed is not None else random.getrandbits(63),
                             self.target.device)
        stop = StopCheck(self.target.tokenizer, self.target.eos_token_ids, params.max_new_tokens, params.stop)
        gamma = params.gamma if params.gamma is not None else self.default_gamma
        ctl = GammaController(self.policy.costs(1), gamma=gamma, fixed=not params.adaptive)
        grammar = None
        if params.structured is not None:
            t = self.target
            grammar = Matcher(vocab_for(t.tokenizer, t.vocab_size, tuple(sorted(t.eos_token_ids))),
                              params.structured)
        return Row(index, list(ids), params, stop, warp, noise, RowProcessors.build(params, len(ids)), ctl,
                   Tally(GenerationStats(prompt_tokens=len(ids))), now,
                   logprobs=None if params.logprobs is None else [], grammar=grammar)

    # -- one step for every row: draft, verify the trees in one forward, accept, roll back
    def _cpu(self) -> float:
        """The process's CPU time, where a governor reads it (engine/contention.py)."""
        return time.process_time() if self.contention is not None else 0.0

    def _step(self) -> None:
        rows, n = self.rows, len(self.rows)
        pending = [r.ids[int(m):] for r, m in zip(rows, self.cache.n_valid.tolist())]
        with_prompts = any(len(p) > 1 for p in pending)   # a fresh batch caches its prompts now
        # 1. draft: each row's gamma, capped by the policy and by what the row may still emit
        k = self._gammas()
        if any(k) and self.drafts_behind:     # this step's drafting also catches the drafts up
            with_prompts, self.drafts_behind = True, False
        elif not any(k) and any(d.keeps_cache for d in self.drafters):
            self.drafts_behind = True
        # (every clock read waits for the device: on CUDA a forward returns before its work is done)
        t0, c0 = clock.now(self.target.device), self._cpu()
        proposals = [d.propose(rows, k) for d in self.drafters] if any(k) else []
        # (structured rows: no draft token the grammar refuses; the tokens it forces, a chain)
        proposals = constrained.trim(rows, proposals)
        forced = [constrained.forced(r, min(MAX_DRAFT, r.params.max_new_tokens - len(r.generated) - 1))
                  if self.grammar_drafts else None for r in rows]
        if any(f is not None for f in forced):    # (cut where the padded verify costs more than it brings)
            cap = constrained.forced_cap([0 if f is None else len(f.tokens) for f in forced],
                                         max((len(p.tokens) for props in proposals for p in props if p), default=0),
                                         self.policy.costs(n).verify_cost)
            forced = [None if f is None or cap == 0 else Proposal(f.tokens[:cap]) for f in forced]
        t1 = clock.now(self.target.device)
        # 2. verify: one target forward over each row's pending tokens (root last) and its tree
        trees = [self._tree(b, [props[b] for props in proposals], forced[b]) for b in range(n)]
        scored = max(t.n_nodes for t in trees) + 1    # positions whose logits come back, per row
        chains = all(t.is_chain for t in trees)   # (then BatchCache may use the causal mask)
        # (the grammar's masks need only the trees: computed on a helper thread during the forward)
        masks = _MASKS.submit(constrained.tree_masks, rows, trees) if any(r.grammar for r in rows) else None
        try:
            logits = self.cache.forward([p + t.tokens for p, t in zip(pending, trees)], logits_to_keep=scored,
                                        parents=None if chains else
                                        [t.feed_parents(len(p)) for p, t in zip(pending, trees)],
                                        hidden=self.hidden)
        finally:   # (a failed forward still waits: the thread holds the rows' matchers until it is done)
            if masks is not None:
                wait([masks])
        # logprobs are the raw target's (docs/FORMATS.md), read before the grammar masks them
        raw = logits.clone() if any(r.grammar is not None and r.logprobs is not None for r in rows) else logits
        if masks is not None:                          # p: the constrained target's, at every node
            constrained.mask_logits(masks.result(), trees, logits)
        verdicts = self._verify(trees, logits)
        self._logprobs(trees, raw, verdicts)
        t2 = clock.now(self.target.device)
        if self.contention is not None:
            self.contention.observe(t2 - t0, time.process_time() - c0)
        if with_prompts and self.prefixes is not None:     # a fresh batch's prefill: a rate too
            self.prefixes.observe(t2 - t1, sum(len(p) for p in pending))
        # 3. roll back: the nodes off each row's accepted path become holes (drafters: their own)
        self.cache.reject([[len(p) + j - 1 for j in range(1, t.n_nodes + 1) if j not in v.path]
                           for p, t, v in zip(pending, trees, verdicts)])
        hidden = self._accepted_hidden(trees, verdicts, scored) if self.hidden else None
        for d in self.drafters if proposals else ():   # (a plain step: nothing to judge them on)
            d.observe(rows, [v.tokens for v in verdicts], hidden)
        # 4. statistics, as data; the measured step steers gamma
        self.policy.observe(StepReport(n, max(t.depth for t in trees), sum(t.depth for t in trees),
                                       sum(len(v.tokens) for v in verdicts), t1 - t0, t2 - t1, with_prompts))
        # a step that drafted nothing had no drafting phase: its few microseconds of bookkeeping
        # count as verification (qa50: a job that never drafted showed draft seconds)
        # (a drafter that ran and proposed nothing, the n-gram one without a match: nothing drafted)
        drafted = any(p is not None for props in proposals for p in props) or any(f is not None for f in forced)
        drafting = t1 - t0 if drafted else 0.0
        for b, (r, t, v) in enumerate(zip(rows, trees, verdicts)):
            forwards = sum(p.forwards for props in proposals if (p := props[b]) is not None)
            winner = self._member_name(v.winner)
            if (f := forced[b]) is not None:
                r.tally.stats.grammar_drafted_tokens += len(f.tokens)
                r.tally.stats.grammar_accepted_tokens += common_prefix(f.tokens, v.tokens[:v.n_accepted])
            r.tally.step(t.depth, v.n_accepted, v.winner, winner, draft_forwards=forwards,
                         draft_seconds=drafting, verify_seconds=t2 - t0 - drafting)
            # (free text: the tree is the drafters' own; a forced run is not theirs to learn from)
            r.ctl.observe(*(constrained.drafters_part([props[b] for props in proposals], forced[b],
                                                       v.tokens[:v.n_accepted])
                            if forced[b] is not None else (t.depth, v.n_accepted)))
            self._accept(r, v)
        seconds = clock.now(self.target.device) - t0
        for r in rows:   # each row's share of the step's time, by rows in the step (job statistics)
            r.tally.batch_share(n, seconds / n)
        if self.memory is not None:
            self.memory.check(measure(self.target.device), n, max(self._columns(r) for r in rows),
                              max(draft_width(r.params, self.default_gamma) for r in rows))

    def _columns(self, r: Row) -> int:
        """The cache columns row ``r`` may grow to (``memory.row_columns`` of its prompt)."""
        return row_columns(len(r.ids) - len(r.generated), r.params, self.default_gamma)

    def _gammas(self) -> list[int]:
        if not self.drafters:
            return [0] * len(self.rows)
        cap = self.policy.gamma_cap(len(self.rows))
        costs = self.policy.costs(len(self.rows))
        ks = []
        for r in self.rows:
            r.ctl.costs = costs
            k = r.ctl.next_gamma()
            if cap is not None and not r.ctl.fixed:
                k = min(k, cap)
            ks.append(max(0, min(k, r.params.max_new_tokens - len(r.generated) - 1)))
        return ks

    def _tree(self, b: int, proposals: list[Proposal | None], forced: Proposal | None = None) -> TokenTree:
        """Row b's tree: the members in pool order (a tie of the accepted path goes to the first),
        the grammar's forced chain (member index len(drafters)) first, where there is one."""
        if forced is not None:
            return build_tree([*proposals, forced], [len(proposals), *range(len(proposals))])
        return build_tree(proposals)

    def _member_name(self, winner: int) -> str:
        """The pool name of a tree's winning member (the grammar's chain: after the drafters)."""
        if winner < 0:
            return ""
        return self.drafters[winner].name if winner < len(self.drafters) else constrained.GRAMMAR

    def _verify(self, trees: list[TokenTree], logits: torch.Tensor) -> list[Verdict]:
        """logits: (B, scored, V); row b's root is at column scored - 1 - n_nodes(b).

        A row with logit processors has its logits processed at every node with that node's
        history (the accepted ids plus the drafted tokens on the node's path), as the drafts'
        q were: then the verifiers are exact for the processed target."""
        scored = logits.shape[1]
        plain_greedy = any(r.warp is None and r.procs is None for r in self.rows)
        argmax = logits.argmax(dim=-1).tolist() if plain_greedy else []
        out = []
        for b, (r, t) in enumerate(zip(self.rows, trees)):
            start = scored - 1 - t.n_nodes
            x = logits[b, start:]
            if r.procs is not None:
                x = r.procs(x, r.ids, t.branches())
            if r.warp is None:
                ids = x.argmax(dim=-1).tolist() if r.procs is not None else argmax[b][start:]
                out.append(verify_greedy(t, ids))
            else:
                assert r.noise is not None, "a sampled row has its noise"
                out.append(verify_race(t, r.warp.probs(x), r.noise))
        return out

    def _accepted_hidden(self, trees: list[TokenTree], verdicts: list[Verdict], scored: int
                         ) -> list[torch.Tensor]:
        """Per row (len(tokens), H): the target's final hidden state at the root and at each
        accepted node, the positions whose logits chose the row's emitted tokens."""
        states = self.cache.last_hidden
        assert states is not None, "the backend keeps hidden states when asked"
        out = []
        for b, (t, v) in enumerate(zip(trees, verdicts)):
            start = scored - 1 - t.n_nodes
            out.append(states[b, [start] + [start + j for j in v.path]])
        return out

    def _logprobs(self, trees: list[TokenTree], logits: torch.Tensor, verdicts: list[Verdict]) -> None:
        """Rows that ask for them record each emitted token's log-probability under the target:
        the raw log-softmax of the verification logits at the node before it (the root, then
        the accepted path), the same numbers the target alone gives (docs/FORMATS.md)."""
        scored = logits.shape[1]
        for b, (r, t, v) in enumerate(zip(self.rows, trees, verdicts)):
            if r.logprobs is None:
                continue
            start = scored - 1 - t.n_nodes
            cols = torch.tensor([start] + [start + j for j in v.path], device=logits.device)
            lp = logits[b].index_select(0, cols).float().log_softmax(dim=-1)      # (len(tokens), V)
            chosen = lp.gather(1, torch.tensor(v.tokens, device=lp.device)[:, None])[:, 0].tolist()
            k = r.params.logprobs or 0
            top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            for x, c, tv, ti in zip(v.tokens, chosen, top_v.tolist(), top_i.tolist()):
                r.logprobs.append(TokenLogprob(x, c, tuple(zip(ti, tv)), self.token_bytes(x),
                                               tuple(self.token_bytes(i) for i in ti)))

    def _accept(self, r: Row, v: Verdict) -> None:
        """Extend the row's sequence; stop on EOS, max_new_tokens or a stop string."""
        r.ids.extend(v.tokens)
        r.generated.extend(v.tokens)
        if r.noise is not None:
            r.noise.advance(len(v.tokens))
        end, reason = r.stop.step(r.generated, len(v.tokens))
        if reason is not None:
            del r.generated[end:]
            if r.logprobs is not None:
                del r.logprobs[end:]
            r.finish = reason
        # a finished row's grammar is done with (tokens past its EOS were never masked for it)
        elif r.grammar is not None and not r.grammar.advance(v.tokens):
            # every token emitted was allowed by its mask: a refusal here is a bug, not bad input
            raise RuntimeError(f"structured output: the grammar refused emitted tokens: {r.grammar.error}")

    def _retire(self) -> Iterator[tuple[int, GenerationOutput]]:
        if all(r.finish is None for r in self.rows):
            return
        staying = _refill([r.finish is None for r in self.rows])
        finished = [r for r in self.rows if r.finish is not None]
        self.rows = [self.rows[i] for i in staying]
        self.cache.select(staying)
        for d in self.drafters:
            d.retire(staying)
        now = time.perf_counter()
        for r in finished:
            if r.tally.stats.cached_prompt_tokens and self.prefixes is not None:
                r.tally.saved(self.prefixes.saved(r.tally.stats.cached_prompt_tokens))
            s = r.tally.close(len(r.generated), r.ctl.gamma, r.ctl.ever_off, now - r.t_start)
            yield r.index, GenerationOutput(r.stop.final_text(r.generated), r.generated,
                                            r.finish or "length", s, r.logprobs)


def _refill(alive: Sequence[bool]) -> list[int]:
    """The rows staying, in their new order: each place of a row leaving is taken by one of the
    last rows staying, so the caches move only those rows (``GrowingLayer.batch_select_indices``)
    instead of every row after the first that left."""
    kept = sum(alive)
    order = list(range(kept))
    movers = [i for i in range(kept, len(alive)) if alive[i]]
    for place, src in zip([i for i in range(kept) if not alive[i]], movers, strict=True):
        order[place] = src
    return order


def _by_length(rows: list[Row], entries: list[PrefixEntry | None], keys: list[int | None]
               ) -> tuple[list[Row], list[PrefixEntry | None], list[int | None]]:
    """Joining rows reordered: each distinct prompt (key; None: a row of its own) by the length
    it has to feed after its prefix, shortest first (a stable sort), its other rows (a request's
    samples) right after it."""
    feed = feed_lengths([r.ids for r in rows], [None if e is None else e.kv[0] for e in entries])
    first: dict[int, int] = {}          # key -> its first row
    groups: dict[int, list[int]] = {}   # first row -> its rows
    for b, k in enumerate(keys):
        lead = b if k is None else first.setdefault(k, b)
        groups.setdefault(lead, []).append(b)
    order = [b for lead in sorted(groups, key=feed.__getitem__) for b in groups[lead]]
    return [rows[b] for b in order], [entries[b] for b in order], [keys[b] for b in order]


def _fork_sources(keys: Sequence[int | None]) -> list[int]:
    """Per joining row, the index of the distinct prompt it takes its cache from (numbered in
    order of first appearance): rows with the same key (a request's samples) share the first
    one's; None (a resumed row, its own context) is always distinct."""
    seen: dict[int, int] = {}
    out: list[int] = []
    n = 0
    for k in keys:
        if k is not None and k in seen:
            out.append(seen[k])
            continue
        if k is not None:
            seen[k] = n
        out.append(n)
        n += 1
    return out
