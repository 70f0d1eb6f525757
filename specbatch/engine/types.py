"""Data the engine takes and returns: parameters in, tokens and statistics out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specbatch.engine import rules
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

    # logit processors (specbatch.engine.processors), applied to p and to every q alike
    presence_penalty: float = 0.0       # OpenAI: minus this once a token is in the generated text
    frequency_penalty: float = 0.0      # OpenAI: minus this per occurrence in the generated text
    repetition_penalty: float = 1.0     # vLLM/HF (CTRL): tokens of prompt + output; 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) pairs
    min_p: float = 0.0                  # drop tokens below min_p * the top token's probability
    logprobs: int | None = None         # return each token's log-probability and this many top
                                        # alternatives (the raw target's log-softmax); None: none
    n: int = 1                          # samples of this request: n rows forked from one prefill,
                                        # sample i seeded by sample_seed(seed, i) (engine.sampling)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):       # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):   # as JSON gives it; validate() checks and normalises
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(p) if isinstance(p, list) else p
                                                         for p in self.logit_bias))
        if isinstance(self.structured, dict):   # as stored in a request's params
            object.__setattr__(self, "structured", GrammarSpec.from_dict(self.structured))

    def validate(self, vocab_size: int | None = None) -> GenerationParams:
        """Raise RequestError naming the first bad field (the rules of specbatch.engine.rules);
        returns the parameters normalised (logit_bias as sorted (int id, float bias) pairs).
        ``vocab_size``: the target's, to check logit_bias token ids against."""
        whole: dict[str, Any] = {}     # integers written as floats (1.0), as the integers they are
        for name, rule in rules.RULES.items():
            value, problem = rule.check(getattr(self, name))
            if problem:
                raise RequestError(problem, field=name)
            if rule.integer and value is not None:
                whole[name] = value
        _, problem = rules.check_stop(self.stop)
        if problem:
            raise RequestError(problem, field="stop")
        bias, problems = rules.check_logit_bias(self.logit_bias, vocab_size)
        if problems:
            where, why = problems[0]
            raise RequestError(why, field="logit_bias" + where)
        if self.structured is not None and (problem := spec_problem(self.structured)):
            raise RequestError(problem, field="structured")
        return replace(self, logit_bias=tuple(sorted(bias.items())), **whole)

    @property
    def processed(self) -> bool:
        """Whether any logit processor changes the target's logits (see processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationStats:
    """Statistics of one request, filled by its Tally; definitions in docs/statistics.md."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0       # of those, read from the prefix cache (not prefilled)
    prefill_seconds_saved: float = 0.0  # its prefill at the fastest rate measured (PrefixStore.saved)
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


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (its raw log-softmax, from the
    verification forward, never a draft) and the ``top`` most likely tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()      # (token id, logprob), most likely first
    raw: bytes = b""                             # the token's own bytes (token_bytes.py)
    top_raw: tuple[bytes, ...] = ()              # those of each top alternative


@dataclass
class GenerationOutput:
    """What one request produced. ``token_ids`` are the new tokens only.

    A request with ``n`` > 1 yields sample 0 with samples 1..n-1 in ``siblings`` (each its own
    row: own tokens, stats, logprobs); ``samples`` lists all n, in sample order."""

    text: str
    token_ids: list[int]
    finish_reason: str                  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None   # per token of token_ids, when params.logprobs is set
    sample_index: int = 0
    siblings: list[GenerationOutput] = field(default_factory=list)

    @property
    def samples(self) -> list[GenerationOutput]:
        return [self, *self.siblings]

    def to_dict(self) -> dict[str, Any]:
        d = {"text": self.text, "token_ids": list(self.token_ids),
             "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            d["logprobs"] = [{"token": t.token, "logprob": t.logprob, "top": [list(x) for x in t.top],
                              "bytes": list(t.raw)} for t in self.logprobs]
        if self.siblings:
            d["samples"] = [o.to_dict() for o in self.siblings]
        return d
