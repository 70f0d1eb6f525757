"""Tests only, imported in a pool child: the target fails on every generation (a broken GPU)."""

from __future__ import annotations

from specbatch.worker import tasks

_real_build = tasks.build_engine


class _BrokenEngine:
    def __init__(self, engine):  # noqa: ANN001
        self._engine = engine

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._engine, name)

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):  # noqa: ANN001, ANN201
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield  # a generator, like the real one


def _build(spec, *args):  # noqa: ANN001, ANN002, ANN202
    return _BrokenEngine(_real_build(spec, *args))


tasks.build_engine = _build
