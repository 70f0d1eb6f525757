"""One way of generating per configuration, all behind the same call: ids -> tokens + time.

Baselines call Hugging Face ``generate`` directly (target alone, assisted generation, prompt
lookup); ours call ``Engine.generate``. Every runner is greedy and returns the new tokens cut at
the first EOS, so outputs compare token for token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specbatch.engine import clock
from specbatch.engine.loading import LoadedModel
from specbatch.engine.types import GenerationParams, GenerationStats

# Hugging Face assisted generation settings people would use: its defaults and hand-tuned ones.
HF_ASSISTED_SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4},
    "const3": {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant",
               "assistant_confidence_threshold": 0.4},
    "const5": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant",
               "assistant_confidence_threshold": 0.4},
    "heuristic5": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                   "assistant_confidence_threshold": 0.4},
}
# HF's own compiled path with assisted generation (transformers 5: a static cache, and the target's
# forward through torch.compile, which on CPU it does only when told to compile on every device):
# the assistant settings of the one named
HF_COMPILED_SETTINGS: dict[str, str] = {"compiled5": "const5"}
HF_ASSISTED_SETTINGS |= {name: HF_ASSISTED_SETTINGS[like] for name, like in HF_COMPILED_SETTINGS.items()}


@dataclass
class RunOutput:
    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None


def cut_at_eos(tokens: Sequence[int], eos: frozenset[int]) -> list[int]:
    """New tokens up to (not including) the first EOS."""
    out: list[int] = []
    for t in tokens:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where two outputs differ (the shorter's length where one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def generate_all(engine: Any, reqs: Sequence[Any], device: torch.device) -> tuple[list[Any], float]:
    """Every request's ``EngineOutput`` through ``engine.generate_many``, in request order, and
    the wall seconds; a request's exception ends the run (a benchmark of ours never drops one)."""
    outs: list[Any] = [None] * len(reqs)
    t0 = clock.now(device)
    for i, out in engine.generate_many(reqs):
        if isinstance(out, Exception):
            raise RuntimeError(f"prompt {i}: {out}")
        outs[i] = out
    return outs, clock.now(device) - t0


def _greedy_config(lm: LoadedModel, max_new_tokens: int, **extra: Any) -> Any:
    from transformers import GenerationConfig

    pad = lm.tokenizer.pad_token_id
    eos = sorted(lm.eos_token_ids)
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=pad if pad is not None else eos[0], **extra)


def _inductor_defaults(compiles: bool) -> Any:
    """Inductor as HF users get it while HF compiles (``configure_inductor`` set freezing and
    max-autotune process-wide for our compiled forward, which would not be HF's own path)."""
    if not compiles:
        return contextlib.nullcontext()
    from specbatch.engine.compile.inductor import defaults

    return defaults()


class HFRunner:
    """``model.generate`` greedy: the target alone, or with an assistant / prompt lookup."""

    def __init__(self, target: LoadedModel, assistant: LoadedModel | None = None,
                 assistant_settings: dict[str, Any] | None = None,
                 prompt_lookup_num_tokens: int | None = None, compiled: bool = False) -> None:
        self.target, self.assistant = target, assistant
        self.assistant_settings = dict(assistant_settings or {})
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        # HF recompiles while its static cache's size (the longest prompt + new tokens so far) grows
        # and per draft length: warm it on every prompt, in full, not one (``compiles``)
        self.compiles = compiled

    def __call__(self, ids: list[int], max_new_tokens: int) -> RunOutput:
        lm = self.target
        extra: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        if self.prompt_lookup_num_tokens:
            extra["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        if self.compiles:
            from transformers import CompileConfig

            compile_config = CompileConfig()
            compile_config._compile_all_devices = True  # type: ignore[assignment]  # HF: CPU too
            extra |= {"cache_implementation": "static", "compile_config": compile_config}
        if self.assistant is not None:
            # HF reads (and with "heuristic" writes back) these on the assistant's own config:
            # reset them before every call so one configuration never leaks into the next.
            gc = self.assistant.model.generation_config
            for key, value in self.assistant_settings.items():
                setattr(gc, key, value)
            kwargs["assistant_model"] = self.assistant.model
        config = _greedy_config(lm, max_new_tokens, **extra)
        inp = torch.tensor([ids], dtype=torch.long, device=lm.device)
        with torch.inference_mode(), _inductor_defaults(self.compiles):
            t0 = clock.now(lm.device)
            out = lm.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                                    generation_config=config, **kwargs)
            seconds = clock.now(lm.device) - t0
        return RunOutput(cut_at_eos(out[0, len(ids):].tolist(), lm.eos_token_ids), seconds)

    def batch(self, batch_ids: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
        """The target alone on a left-padded batch (throughput baseline); (tokens per row, seconds)."""
        lm = self.target
        config = _greedy_config(lm, max_new_tokens)
        width = max(len(x) for x in batch_ids)
        pad = config.pad_token_id
        inp = torch.tensor([[pad] * (width - len(x)) + list(x) for x in batch_ids], device=lm.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids], device=lm.device)
        with torch.inference_mode():
            t0 = clock.now(lm.device)
            out = lm.model.generate(input_ids=inp, attention_mask=mask, generation_config=config)
            seconds = clock.now(lm.device) - t0
        return [cut_at_eos(row[width:].tolist(), lm.eos_token_ids) for row in out], seconds


class EngineRunner:
    """Ours: ``Engine.generate`` with a fixed gamma or the engine's adaptive control."""

    def __init__(self, engine: Any, gamma: int | None = None, adaptive: bool = True) -> None:
        self.engine, self.gamma, self.adaptive = engine, gamma, adaptive

    def params(self, max_new_tokens: int) -> GenerationParams:
        return GenerationParams(max_new_tokens=max_new_tokens, gamma=self.gamma, adaptive=self.adaptive)

    def __call__(self, ids: list[int], max_new_tokens: int) -> RunOutput:
        device = self.engine.target.device
        t0 = clock.now(device)
        out = self.engine.generate(input_ids=list(ids), params=self.params(max_new_tokens))
        seconds = clock.now(device) - t0
        return RunOutput(cut_at_eos(out.token_ids, self.engine.target.eos_token_ids), seconds, out.stats)

    def batch(self, batch_ids: list[list[int]], max_new_tokens: int, batch_size: int
              ) -> tuple[list[list[int] | Exception], float]:
        """All prompts through ``generate_many`` at ``batch_size``; (tokens or error per row, seconds)."""
        from specbatch.engine import EngineRequest

        params = self.params(max_new_tokens)
        reqs = [EngineRequest(input_ids=list(x), params=params) for x in batch_ids]
        rows: list[list[int] | Exception] = [RuntimeError("no result")] * len(reqs)
        device = self.engine.target.device
        t0 = clock.now(device)
        for i, res in self.engine.generate_many(reqs, batch_size=batch_size):
            rows[i] = res if isinstance(res, Exception) else cut_at_eos(
                res.token_ids, self.engine.target.eos_token_ids)
        return rows, clock.now(device) - t0
