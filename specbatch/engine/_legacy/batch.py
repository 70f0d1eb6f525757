"""Batched speculative decoding with continuous batching and ragged acceptance.

All rows draft together (one draft forward per draft position for the whole batch) and are
verified together (one target forward per step); each row accepts its own number of tokens.
Rejected tokens become holes in the batch KV caches (see ``BatchCache``), so no row waits for
another and rollback is per row. Finished rows leave the batch and waiting requests join it,
prefilled on their own and merged in. Greedy rows equal the target's own greedy decoding; sampled
rows keep the target's distribution (the per-row verification is the single-request one).

Pool in a batch: one draft model and/or the n-gram drafter; each row verifies the chain of the
member with the better recent acceptance on that row. A pool of several draft models decodes
request by request (token-tree verification) instead.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from specbatch.engine._legacy.cache import BatchCache
from specbatch.engine._legacy.drafters import NgramDrafter, fit_vocab
from specbatch.engine._legacy.gamma import CostModel, GammaController
from specbatch.engine._legacy.sampling import Verdict, Warp, sample, verify_sampling
from specbatch.engine._legacy.speculative import Tally
from specbatch.engine._legacy.speculative import common_prefix as _common_prefix
from specbatch.engine.loading import LoadedModel
from specbatch.engine.stopping import StopCheck
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats

COMPACT_HOLES = 0.5      # squeeze holes out of a cache once this share of its columns are holes
COMPACT_MIN_COLS = 64


@dataclass
class Row:
    index: int
    ids: list[int]
    params: GenerationParams
    stop: StopCheck
    warp: Warp | None
    generator: torch.Generator | None
    ngram: NgramDrafter | None
    t_start: float
    tally: Tally
    generated: list[int] = field(default_factory=list)
    score: dict[str, float] = field(default_factory=lambda: {"model": 0.5, "ngram": 0.4})
    finish: str | None = None


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class BatchDecoder:
    """Decodes many requests, at most ``max_batch`` at a time. Call under inference mode."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, ngram: bool,
                 costs: dict[int, CostModel], gamma: int, max_batch: int) -> None:
        self.target, self.draft, self.use_ngram = target, draft, ngram
        self.costs, self.max_batch = costs, max_batch
        self.ctl = GammaController(self._costs(1), gamma=gamma)
        self.rows: list[Row] = []
        self.tcache = BatchCache(target)
        self.dcache = BatchCache(draft) if draft is not None else None
        self.vocab = target.vocab_size

    def _costs(self, n_rows: int) -> CostModel:
        return self.costs.setdefault(_bucket(n_rows), CostModel())

    def run(self, requests: Iterable[tuple[int, list[int], GenerationParams]]
            ) -> Iterator[tuple[int, GenerationOutput]]:
        waiting = deque(requests)
        while waiting or self.rows:
            joining = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch - len(self.rows)))]
            if joining:
                self._admit(joining)
            else:
                self._step()
            yield from self._retire()

    # -- admission: prefill new rows on their own, emit their first token, merge caches
    def _admit(self, joining: list[tuple[int, list[int], GenerationParams]]) -> None:
        t0 = time.perf_counter()
        new = [self._new_row(i, ids, p, t0) for i, ids, p in joining]
        tc = BatchCache(self.target, len(new))
        logits = tc.forward([r.ids for r in new], logits_to_keep=1)[:, -1]
        if self.dcache is not None:
            dc = BatchCache(self.draft, len(new))
            dc.forward([r.ids for r in new], logits_to_keep=1)
            self.dcache.extend(dc)
        self.tcache.extend(tc)
        seconds = time.perf_counter() - t0
        for r, row_logits in zip(new, logits):
            x = int(row_logits.argmax()) if r.warp is None else sample(r.warp.probs(row_logits), r.generator)
            r.tally.stats.target_forwards += 1
            r.tally.stats.draft_forwards += int(self.dcache is not None)
            r.tally.stats.verify_seconds += seconds
            self._accept(r, Verdict([x], 0, [], -1), drafted=0)
        self.rows.extend(new)

    def _new_row(self, index: int, ids: list[int], params: GenerationParams, now: float) -> Row:
        warp = None if params.greedy else Warp(params.temperature, params.top_k, params.top_p)
        gen = None
        if warp is not None:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        stop = StopCheck(self.target.tokenizer, self.target.eos_token_ids, params.max_new_tokens, params.stop)
        return Row(index, list(ids), params, stop, warp, gen, NgramDrafter() if self.use_ngram else None,
                   now, Tally(GenerationStats(prompt_tokens=len(ids))))

    # -- one step for every row: draft k, verify, accept per row, roll back per row
    def _step(self) -> None:
        rows = self.rows
        costs = self._costs(len(rows))
        if costs is not self.ctl.costs:
            self.ctl.costs = costs
        k = self.ctl.next_gamma() if (self.dcache is not None or self.use_ngram) else 0
        caps = [max(0, min(k, r.params.max_new_tokens - len(r.generated) - 1)) for r in rows]
        k = max(caps, default=0)
        t0 = time.perf_counter()
        model_chains, qs, n_fed = self._draft_model(k) if k and self.dcache is not None else (None, None, 0)
        chains, members = self._choose_chains(model_chains, qs, k, caps)
        width = max(len(c) for c in chains)
        t1 = time.perf_counter()
        logits = self.tcache.forward([[r.ids[-1]] + c for r, c in zip(rows, chains)],
                                     logits_to_keep=width + 1)
        verdicts = self._verify(logits, chains, members, qs, width)
        t2 = time.perf_counter()
        # roll back: target keeps root + accepted; draft keeps its own tokens that were accepted
        self.tcache.drop_tail([len(c) - v.n_accepted for c, v in zip(chains, verdicts)])
        if model_chains is not None and self.dcache is not None:
            # (the last accepted token always stays pending: the next draft step starts from it)
            self.dcache.drop_tail([n_fed - min(n_fed, _common_prefix(mc, v.tokens), len(v.tokens) - 1)
                                   for mc, v in zip(model_chains, verdicts)])
        costs.observe_draft(t1 - t0, k if model_chains is not None else 0)
        costs.observe_verify(width + 1, t2 - t1)
        for r, v, c in zip(rows, verdicts, chains):
            r.tally.stats.target_forwards += 1
            r.tally.stats.draft_forwards += k if model_chains is not None else 0
            r.tally.stats.draft_seconds += t1 - t0
            r.tally.stats.verify_seconds += t2 - t1
            if c:
                self.ctl.observe(len(c), v.n_accepted)
            self._accept(r, v, drafted=len(c))
        for cache in (self.tcache, self.dcache):
            if cache is not None and cache.valid.shape[1] > COMPACT_MIN_COLS and cache.holes() > COMPACT_HOLES:
                cache.compact()

    def _draft_model(self, k: int) -> tuple[list[list[int]], list[torch.Tensor | None], int]:
        """k draft tokens per row from the draft model, batched. Returns chains, q per row, and how
        many of the chain tokens were fed to the draft (k - 1)."""
        rows, dcache = self.rows, self.dcache
        assert dcache is not None
        feeds = [r.ids[int(n):] for r, n in zip(rows, dcache.n_valid.tolist())]
        chains: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(k):
            logits = fit_vocab(dcache.forward(feeds, logits_to_keep=1)[:, -1], self.vocab)
            greedy = logits.argmax(dim=-1).tolist()
            for b, r in enumerate(rows):
                if r.warp is None:
                    chains[b].append(greedy[b])
                else:
                    q = r.warp.probs(logits[b])
                    chains[b].append(int(torch.multinomial(q, 1, generator=r.generator)))
                    qs[b].append(q)
            if j + 1 == k:
                break
            feeds = [[c[-1]] for c in chains]
        return chains, [torch.stack(q) if q else None for q in qs], k - 1

    def _choose_chains(self, model_chains, qs, k: int, caps: list[int]):
        """Per row: the model's chain or the n-gram's, whichever accepted better lately."""
        chains, members = [], []
        for b, r in enumerate(self.rows):
            options = {}
            if model_chains is not None:
                options["model"] = model_chains[b]
            if r.ngram is not None and k:
                prop = r.ngram.propose(r.ids, k, None, None)
                if prop is not None:
                    options["ngram"] = prop.tokens
            member = max(options, key=r.score.__getitem__) if options else "model"
            chains.append(options.get(member, [])[: caps[b]])
            members.append(member)
        return chains, members

    def _verify(self, logits: torch.Tensor, chains, members, qs, k: int) -> list[Verdict]:
        """logits: (B, k + 1, V) with k the longest chain; row b's root is at column k - len(chain)."""
        argmax = logits.argmax(dim=-1).tolist() if any(r.warp is None for r in self.rows) else None
        out = []
        for b, (r, c) in enumerate(zip(self.rows, chains)):
            start = k - len(c)
            if r.warp is None:
                assert argmax is not None
                a = argmax[b][start:]
                n = _common_prefix(c, a)
                v = Verdict(a[: n + 1], n, list(range(1, n + 1)))
            else:
                q = qs[b][: len(c)] if (qs is not None and members[b] == "model" and qs[b] is not None) else None
                draft = torch.tensor(c, dtype=torch.long, device=logits.device)
                v = verify_sampling(draft, q, r.warp.probs(logits[b, start:]), r.generator)
            if c:
                hit = v.n_accepted / len(c)
                r.score[members[b]] = 0.7 * r.score[members[b]] + 0.3 * hit
            out.append(Verdict(v.tokens, v.n_accepted, v.path, 0 if members[b] == "model" else 1))
        return out

    def _accept(self, r: Row, v: Verdict, drafted: int) -> None:
        winner = v.winner if v.n_accepted else -1
        r.tally.step(drafted, v.n_accepted, winner, self._member_name(winner) if winner >= 0 else "")
        r.ids.extend(v.tokens)
        r.generated.extend(v.tokens)
        keep, reason = r.stop.step(r.generated, len(v.tokens))
        if reason is not None:
            del r.generated[keep:]
            r.finish = reason

    def _member_name(self, winner: int) -> str:
        return self.draft.name if winner == 0 and self.draft is not None else "ngram"

    def _retire(self) -> Iterator[tuple[int, GenerationOutput]]:
        done = [i for i, r in enumerate(self.rows) if r.finish is not None]
        if not done:
            return
        keep = [i for i, r in enumerate(self.rows) if r.finish is None]
        finished = [self.rows[i] for i in done]
        self.rows = [self.rows[i] for i in keep]
        self.tcache.select(keep)
        if self.dcache is not None:
            self.dcache.select(keep)
        now = time.perf_counter()
        for r in finished:
            s = r.tally.close(len(r.generated), self.ctl, now - r.t_start)
            yield r.index, GenerationOutput(r.stop.final_text(r.generated), r.generated, r.finish or "length", s)

