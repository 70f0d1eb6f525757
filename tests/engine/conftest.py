from __future__ import annotations

import pytest

from specbatch.engine.loading import load_model


@pytest.fixture(scope="session")
def load(tiny_models):
    """load(name) -> LoadedModel for a tiny model, cached for the session."""
    cache = {}

    def _load(name: str):
        if name not in cache:
            cache[name] = load_model(str(tiny_models / name))
        return cache[name]

    return _load
