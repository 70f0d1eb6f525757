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


@pytest.fixture
def count_products(monkeypatch):
    """A list that grows by one per int8 product (one fbgemm or _int_mm call)."""
    calls: list[int] = []
    from specbatch.engine import int8

    forward = int8.RowInt8Linear.forward

    def counted(self, x):
        calls.append(self.out_features)
        return forward(self, x)

    monkeypatch.setattr(int8.RowInt8Linear, "forward", counted)
    return calls
