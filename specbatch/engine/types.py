"""Data the engine takes and returns: parameters in, tokens and statistics out."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specbatch.engine.grammar_spec import GrammarSpec, spec_problem
from specbatch.errors import RequestError


@dataclass(frozen=True)
class GenerationParams:
    """Per-request decoding parameters. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    gamma: int | None = None            # initial draft length; None: the engine's default
    adaptive: bool = True               # adapt gamma and switch speculation off when it does not pay
    structured: GrammarSpec | None = None   # the output's grammar (docs/STRUCTURED.md); None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):       # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.structured, dict):   # as stored in a request's params
            object.__setattr__(self, "structured", GrammarSpec.from_dict(self.structured))

    def validate(self) -> GenerationParams:
        """Raise RequestError naming the bad field; returns self for chaining."""
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError("must be an integer >= 1", field="max_new_tokens")
        if not is_num(self.temperature) or self.temperature < 0:
            raise RequestError("must be a number >= 0", field="temperature")
        if not is_num(self.top_p) or not (0 < self.top_p <= 1):
            raise RequestError("must be a number in (0, 1]", field="top_p")
        if not is_int(self.top_k) or self.top_k < 0:
            raise RequestError("must be an integer >= 0", field="top_k")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise RequestError("must be an integer in [0, 2**63)", field="seed")
        if self.gamma is not None and (not is_int(self.gamma) or not 0 <= self.gamma <= 64):
            raise RequestError("must be an integer in [0, 64]", field="gamma")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", field="stop")
        if self.structured is not None and (problem := spec_problem(self.structured)):
            raise RequestError(problem, field="structured")
        return self

    @property
    def fixed_gamma(self) -> bool:
        """Seeded sampling keeps gamma fixed: adaptation follows wall-clock costs, and the random
        draws follow gamma, so an adaptive gamma would make a seeded output irreproducible."""
        return not self.adaptive or (self.temperature > 0 and self.seed is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationStats:
    """Statistics of one request, filled by its Tally; definitions in docs/statistics.md."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    verify_steps: int = 0               # target forwards that verified a draft (or decoded plainly)
    draft_steps: int = 0                # verify steps that drafted at least one token (vLLM num_drafts)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[float] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)  # steps that accepted position j
    target_forwards: int = 0
    draft_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    first_token_seconds: float = 0.0    # request start -> its first token (the prefill step)
    pool_wins: dict[str, int] = field(default_factory=dict)  # drafter name -> steps it won
    step_winners: list[int] = field(default_factory=list)    # per step: pool index, -1 if none
    grammar_drafted_tokens: int = 0     # structured output: forced tokens the grammar proposed
    grammar_accepted_tokens: int = 0    # ... and how many of them were accepted
    final_gamma: int = 0
    speculation_disabled: bool = False
    # this request's share of decode time by active rows in the step ("16": seconds / 16 summed
    # over the steps it took at 16 rows): summed over a job's requests, the job's time per size
    batch_size_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.verify_steps
        return (self.accepted_tokens + steps) / steps if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_acceptance_length"] = self.mean_acceptance_length
        d["tokens_per_second"] = self.tokens_per_second
        return d


@dataclass
class GenerationOutput:
    """What one request produced. ``token_ids`` are the new tokens only."""

    text: str
    token_ids: list[int]
    finish_reason: str                  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": list(self.token_ids),
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
