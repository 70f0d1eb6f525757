"""The speculative decoding loop for one request: draft -> verify -> accept -> roll back.

Layers, each calling only the one below (gpt-fast style):
``speculative_generate`` -> ``speculative_step`` -> ``target_forward`` / ``verify`` -> sampling.
Call under ``torch.inference_mode()``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specbatch.engine._legacy.cache import cache_length, rollback
from specbatch.engine._legacy.drafters import Drafter, Proposal
from specbatch.engine._legacy.gamma import CostModel, GammaController
from specbatch.engine._legacy.sampling import Verdict, Warp, verify_greedy, verify_sampling
from specbatch.engine._legacy.tree import (
    TokenTree,
    build_tree,
    tree_mask,
    verify_tree_greedy,
    verify_tree_sampling,
)
from specbatch.engine.loading import LoadedModel
from specbatch.engine.stopping import StopCheck
from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats


@dataclass
class StepResult:
    verdict: Verdict
    drafted: int           # depth of the draft tree (the step's draft length)
    draft_seconds: float
    verify_seconds: float
    draft_forwards: int


@dataclass
class Tally:
    """Folds each verify step into a request's GenerationStats (single and batched decoding)."""

    stats: GenerationStats
    drafted_at: list[int] = field(default_factory=list)    # steps that drafted position j
    accepted_at: list[int] = field(default_factory=list)   # steps that accepted position j
    t_start: float = field(default_factory=time.perf_counter)

    def step(self, drafted: int, n_accepted: int, winner: int, winner_name: str) -> None:
        s = self.stats
        s.verify_steps += 1
        if s.verify_steps == 1:   # the first step holds the prompt's forward
            s.first_token_seconds = time.perf_counter() - self.t_start
        s.draft_steps += drafted > 0
        s.drafted_tokens += drafted
        s.accepted_tokens += n_accepted
        grow_counts(self.drafted_at, drafted)
        grow_counts(self.accepted_at, n_accepted)
        s.step_winners.append(winner)
        if winner >= 0:
            s.pool_wins[winner_name] = s.pool_wins.get(winner_name, 0) + 1

    def close(self, new_tokens: int, ctl: GammaController, wall_seconds: float) -> GenerationStats:
        s = self.stats
        s.new_tokens = new_tokens
        accepted = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        s.accepted_per_position = [a / d for a, d in zip(accepted, self.drafted_at)]
        s.accepted_at_position = accepted
        s.final_gamma = ctl.gamma
        s.speculation_disabled = ctl.ever_off
        s.wall_seconds = wall_seconds
        return s


def target_forward(target: LoadedModel, cache: DynamicCache, ids: list[int],
                   tree: TokenTree) -> tuple[torch.Tensor, int]:
    """Score the tokens after the cache plus every tree node in one forward.

    Returns (logits (1 + n_nodes, V) at the root and at each node, number of prefix tokens fed).
    """
    n_cached = cache_length(cache)
    fed = ids[n_cached:]
    n = tree.n_nodes
    inp = torch.tensor([fed + tree.tokens], dtype=torch.long, device=target.device)
    kwargs = {}
    if not tree.is_chain:
        # a branching tree: each node attends to the prefix and to its own ancestors only
        root_pos = n_cached + len(fed) - 1
        pos = list(range(n_cached, n_cached + len(fed))) + [root_pos + d for d in tree.depths]
        kwargs["position_ids"] = torch.tensor([pos], dtype=torch.long, device=target.device)
        kwargs["attention_mask"] = tree_mask(tree, n_cached, len(fed), target.model.dtype,
                                             target.device)
    out = target.forward(inp, cache, logits_to_keep=n + 1, **kwargs)
    return out.logits[0, -(n + 1):], len(fed)


def verify(tree: TokenTree, proposals: list[Proposal | None], logits: torch.Tensor,
           warp: Warp | None, generator: torch.Generator | None) -> Verdict:
    """Pick the lossless verification for this tree: greedy or sampling, chain or pool."""
    if warp is None:
        if tree.is_chain:
            draft = torch.tensor(tree.tokens, dtype=torch.long, device=logits.device)
            v = verify_greedy(draft, logits)
            winner = next((i for i, c in enumerate(tree.chains) if len(c) >= v.n_accepted), -1)
            return Verdict(v.tokens, v.n_accepted, v.path, winner if v.n_accepted else -1)
        return verify_tree_greedy(tree, logits.argmax(dim=-1).tolist())
    p = warp.probs(logits)
    live = [i for i, prop in enumerate(proposals) if prop is not None and prop.tokens]
    if len(live) == 1:
        prop = proposals[live[0]]
        assert prop is not None
        draft = torch.tensor(prop.tokens, dtype=torch.long, device=logits.device)
        v = verify_sampling(draft, prop.q, p, generator)
        return Verdict(v.tokens, v.n_accepted, v.path, live[0] if v.n_accepted else -1)
    return verify_tree_sampling(tree, proposals, p, generator)


def speculative_step(target: LoadedModel, cache: DynamicCache, drafters: list[Drafter],
                     ids: list[int], k: int, warp: Warp | None,
                     generator: torch.Generator | None) -> StepResult:
    """One draft + verify step; on return the target cache holds ids + accepted draft tokens."""
    # 1. draft: every pool member proposes up to k tokens after the accepted sequence
    t0 = time.perf_counter()
    forwards0 = sum(d.forwards for d in drafters)
    proposals = [d.propose(ids, k, warp, generator) for d in drafters] if k > 0 else []
    t1 = time.perf_counter()
    # 2. verify: one target forward over the last accepted token and the whole draft tree
    tree = build_tree(proposals)
    logits, _ = target_forward(target, cache, ids, tree)
    verdict = verify(tree, proposals, logits, warp, generator)
    t2 = time.perf_counter()
    # 3. roll back the target cache to the accepted path (the bonus token is not cached yet)
    rollback(cache, len(ids), [len(ids) - 1 + j for j in verdict.path])
    # 4. tell each drafter how much of its own proposal is now the accepted sequence
    #    (never past the last accepted token: the next proposal starts by feeding it)
    for d, prop in zip(drafters, proposals):
        agreed = common_prefix(prop.tokens if prop else [], verdict.tokens)
        d.observe(len(ids) + min(agreed, len(verdict.tokens) - 1))
    drafted = max((len(c) for c in tree.chains), default=0)
    return StepResult(verdict, drafted, t1 - t0, t2 - t1,
                      sum(d.forwards for d in drafters) - forwards0)


def speculative_generate(target: LoadedModel, drafters: list[Drafter], prompt_ids: list[int],
                         params: GenerationParams, costs: CostModel,
                         default_gamma: int = 4) -> GenerationOutput:
    """Decode one request. Greedy output equals the target's own greedy decoding token for token;
    sampled output has exactly the target's (warped) distribution."""
    t_start = time.perf_counter()
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    warp = None if params.greedy else Warp(params.temperature, params.top_k, params.top_p)
    generator = None
    if warp is not None:
        generator = torch.Generator(device=target.device)
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    ctl = GammaController(costs, gamma=params.gamma if params.gamma is not None else default_gamma,
                          adaptive=not params.fixed_gamma)
    stop = StopCheck(target.tokenizer, target.eos_token_ids, params.max_new_tokens, params.stop)
    cache = DynamicCache()
    ids, generated = list(prompt_ids), list[int]()
    tally = Tally(stats, t_start=t_start)
    while True:
        remaining = params.max_new_tokens - len(generated)
        k = min(ctl.next_gamma(), remaining - 1) if drafters else 0
        step = speculative_step(target, cache, drafters, ids, max(k, 0), warp, generator)
        v = step.verdict
        # statistics, as data
        tally.step(step.drafted, v.n_accepted, v.winner, drafters[v.winner].name if v.winner >= 0 else "")
        stats.target_forwards += 1
        stats.draft_forwards += step.draft_forwards
        stats.draft_seconds += step.draft_seconds
        stats.verify_seconds += step.verify_seconds
        # measured costs steer gamma (prefill steps are not representative)
        # (keyed by draft depth: a pool's tree costs what its depth costs with that pool)
        costs.observe_draft(step.draft_seconds, step.drafted)
        if stats.verify_steps > 1:
            costs.observe_verify(step.drafted + 1, step.verify_seconds)
        ctl.observe(step.drafted, v.n_accepted)
        # accept the tokens, then stop on EOS, max_new_tokens or a stop string
        ids.extend(v.tokens)
        generated.extend(v.tokens)
        keep, reason = stop.step(generated, len(v.tokens))
        if reason is not None:
            del generated[keep:]
            break
    tally.close(len(generated), ctl, time.perf_counter() - t_start)
    return GenerationOutput(text=stop.final_text(generated), token_ids=generated,
                            finish_reason=reason or "length", stats=stats)


def grow_counts(counts: list[int], n: int) -> None:
    """counts[j] += 1 for j < n."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for j in range(n):
        counts[j] += 1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
