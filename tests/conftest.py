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
