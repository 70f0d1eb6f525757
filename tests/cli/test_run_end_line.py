"""`specbatch run`'s thread-governor line at its end keeps no engine alive (review50)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

from specbatch.config import Settings


class _FakeEngine:
    compile_plan = None

    def __init__(self, name: str) -> None:
        self.line = f"{name} held"

    def contention_line(self) -> str | None:
        return self.line


def test_run_drops_a_pair_before_the_next_loads_and_still_says_each_governor_line(monkeypatch, capsys) -> None:
    """run_job lets go of a pair's engine before it loads the next (its memory first); the list
    the run-end line read from kept every engine loaded alive until the run's end."""
    from specbatch.cli import queue
    from specbatch.worker import local

    alive: list[weakref.ref[Any]] = []
    seen_alive: list[int] = []

    def load_pair(settings: Any, options: Any, target: str, drafts: list[str], *a: Any, **k: Any) -> Any:
        gc.collect()
        seen_alive.append(sum(r() is not None for r in alive))
        engine = _FakeEngine(target)
        alive.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(local, "load_pair", load_pair)
    monkeypatch.setattr(local, "token_budgets", lambda settings, job_id, ids: [1] * len(ids))
    monkeypatch.setattr(local, "name_runner", lambda settings, job_id, running=True: None)   # (no database here)
    monkeypatch.setattr(local, "_decode", lambda *a, **k: True)
    monkeypatch.setattr(queue, "use_compile_cache", lambda *a, **k: None)
    monkeypatch.setattr(queue, "report_compile", lambda plan, say_eager=True: None)
    monkeypatch.setattr(queue, "_progress", lambda console, jid, total: contextlib.nullcontext(lambda e: None))
    monkeypatch.setattr(queue, "_report", lambda settings, job_id, finished, as_json: None)
    options = local.LoadOptions("cpu", "float32", "auto", "off", "", True, 1)

    job = local.LocalJob("j1", "t0", [], {("a", ()): [1], ("b", ()): [2], ("c", ()): [3]}, resumed=True)
    queue._run_here(Settings.from_env({}), job, options, False)
    assert seen_alive == [0, 0, 0], seen_alive       # no earlier pair's engine alive while the next loads
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("specbatch: ")] == \
        ["specbatch: a held", "specbatch: b held", "specbatch: c held"], err

    # `run FILE` loads the first pair before the job exists and hands it over: it goes too
    first = _FakeEngine("t0")
    alive[:] = [weakref.ref(first)]
    seen_alive.clear()
    job = local.LocalJob("j2", "t0", [], {None: [1], ("b", ()): [2]})
    held = [first]
    del first
    queue._run_here(Settings.from_env({}), job, options, False, held)
    assert seen_alive == [0], seen_alive
