"""Shared fixtures: tiny models built once per test session, settings isolated per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specbatch.config import get_settings
from tests.tiny import build_tiny_models

# Compiling takes minutes on a small CPU: every process the tests start (workers, `specbatch run`)
# decodes eagerly unless a test asks otherwise; tests/engine/test_compiled.py compiles on purpose.
os.environ.setdefault("SPECBATCH_COMPILE", "off")
# One torch thread per test process (and the subprocesses that inherit this environment): the tiny
# models gain nothing from a second intra-op thread, and on a busy 2-core machine two threads spin
# against each other (tests/engine/test_sampling_distribution.py + test_processors_distribution.py
# at load 2.4-3: 131-216 s with 2 threads, 20-22 s with 1, A B B A). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """Directory of tiny saved models (see tests/tiny.py); shared across a test session.

    Built under SPECBATCH_TEST_MODELS if set (lets separate pytest runs reuse one tree).
    """
    root = os.environ.get("SPECBATCH_TEST_MODELS")
    path = Path(root) if root else Path("/tmp/specbatch-tiny-models-v1")
    return build_tiny_models(path)


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Every test sees settings rebuilt from its own environment."""
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(autouse=True)
def _own_threads():
    """What a test's in-process `specbatch run` configured (engine/threads.py: torch threads,
    lanes, whether the thread governor may act) stays its own: without this, every later engine
    of the same test process was governed, and the governor's start-up check ran forwards through
    a compiled test's graphs (3 tests of test_compiled.py failed after a CLI test, in order)."""
    import sys

    from specbatch.engine import threads

    saved = list(threads._SET)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    threads._SET[:] = saved
    if before is not None and torch is not None:
        torch.set_num_threads(before)
