"""Tests only, imported in a pool child: loading the models waits until the file named by
SPECBATCH_TEST_GATE exists (a large model still loading, held as long as a test needs)."""

from __future__ import annotations

import os
import time

from specbatch.worker import tasks

_real_build = tasks.build_engine


def _build(spec, *args):  # noqa: ANN001, ANN002, ANN202
    while not os.path.exists(os.environ["SPECBATCH_TEST_GATE"]):
        time.sleep(0.1)
    return _real_build(spec, *args)


tasks.build_engine = _build
