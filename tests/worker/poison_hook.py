"""Tests only, imported in a pool child: a prompt containing POISON kills the process (os._exit).

Stands in for a request that crashes its worker (segfault, OOM kill) every time it is tried.
"""

from __future__ import annotations

import os

from specbatch.worker import tasks

_real_build = tasks.build_engine


class _PoisonedEngine:
    def __init__(self, engine):  # noqa: ANN001
        self._engine = engine

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._engine, name)

    def generate_many(self, requests, batch_size=None, on_start=None, more=None):  # noqa: ANN001, ANN201
        given = list(requests)

        def start(indices):  # noqa: ANN001, ANN202
            if on_start is not None:
                on_start(indices)
            # the worker dies as the poison request starts decoding (its attempt is charged)
            if any(given[i].prompt and "POISON" in given[i].prompt for i in indices):
                os._exit(13)

        def claimed(room):  # noqa: ANN001, ANN202 - requests the batch claims join ``given``
            out = more(room)
            given.extend(out)
            return out
        return self._engine.generate_many(requests, batch_size=batch_size, on_start=start,
                                          more=claimed if more is not None else None)


def _build(spec, *args):  # noqa: ANN001, ANN002, ANN202
    return _PoisonedEngine(_real_build(spec, *args))


tasks.build_engine = _build
