"""Tests only, imported in a pool child: every decode step of the batch takes 50 ms longer, so
a tiny model's rows stay in the worker's hands long enough for a test to act on them (a quiet
machine decoded a whole six-row job within the first second of a cancel)."""

from __future__ import annotations

import time

from specbatch.engine import decoder

_real_step = decoder.Decoder._step


def _step(self):  # noqa: ANN001, ANN202
    time.sleep(0.05)
    _real_step(self)


decoder.Decoder._step = _step
