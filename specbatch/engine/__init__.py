"""Lossless speculative decoding. Imports torch and transformers only (never db, celery, click).

    from specbatch.engine import Engine, GenerationParams
    engine = Engine.load("smollm2-135m", ["smollm2-135m-int8", "ngram"])
    out = engine.generate(prompt="Write a haiku", params=GenerationParams(max_new_tokens=32))
    out.text, out.token_ids, out.finish_reason, out.stats.acceptance_rate
"""

from specbatch.engine.types import GenerationOutput, GenerationParams, GenerationStats

__all__ = ["Engine", "EngineRequest", "GenerationOutput", "GenerationParams", "GenerationStats"]


def __getattr__(name: str):  # lazy: importing the types must not import torch
    if name in ("Engine", "EngineRequest"):
        from specbatch.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
