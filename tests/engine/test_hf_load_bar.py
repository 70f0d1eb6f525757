"""loading._hf_load puts transformers' GGUF tqdm back whatever other threads do meanwhile (review50)."""

from __future__ import annotations

import threading

import pytest

from specbatch.engine import loading


def test_a_load_waiting_for_another_puts_the_real_bar_back(monkeypatch) -> None:
    """A second thread's _hf_load read the module's tqdm before it took the lock, i.e. the
    first load's disabled one, and put that back when it was done: the bar stayed off for good."""
    hf_gguf = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    real = hf_gguf.tqdm
    waiting = threading.Event()

    class Lock:                      # says when a second thread is about to wait for the lock
        def __init__(self) -> None:
            self.inner = threading.RLock()

        def __enter__(self) -> None:
            if threading.current_thread() is not threading.main_thread():
                waiting.set()
            self.inner.acquire()

        def __exit__(self, *exc: object) -> None:
            self.inner.release()

    monkeypatch.setattr(loading, "_hf_lock", Lock())

    def other() -> None:
        with loading._hf_load():
            pass

    with loading._hf_load():
        assert hf_gguf.tqdm is not real
        second = threading.Thread(target=other)
        second.start()
        assert waiting.wait(10)
    second.join(10)
    assert not second.is_alive()
    assert hf_gguf.tqdm is real
