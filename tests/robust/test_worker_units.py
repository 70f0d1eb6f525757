"""Unit tests: the breaker's back-off, target health, the worker's scratch directory (#16 item 9)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specbatch.config import Settings
from specbatch.worker.breaker import TargetHealth, wait_until_up
from specbatch.worker.runner import worker_dir


def test_probes_back_off_and_stop_once_up() -> None:
    sleeps: list[float] = []
    answers = iter([ConnectionError("down")] * 7 + [None])

    def probe() -> None:
        a = next(answers)
        if a is not None:
            raise a
    assert wait_until_up(probe, what="the database", first=1.0, maximum=8.0, sleep=sleeps.append) == 8
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0]   # never a hot loop, capped


def test_target_health_counts_consecutive_failures() -> None:
    h = TargetHealth(limit=3)
    assert not h.failed(RuntimeError("CUDA error")) and not h.failed(RuntimeError("x"))
    h.ok()
    assert not h.failed(RuntimeError("a")) and not h.failed(RuntimeError("b"))
    assert h.failed(RuntimeError("c")) and h.unhealthy and "RuntimeError: c" in h.last_error


def test_worker_dir_removes_what_killed_workers_left(tmp_path: Path) -> None:
    settings = Settings(database_url="sqlite://", ready_dir=str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    base = tmp_path / f"specbatch-{os.getuid()}" / "workers"
    (base / dead).mkdir(parents=True)
    (base / dead / "ready").write_text("ok\n")                 # a SIGKILLed worker's leftovers
    alive = base / str(os.getppid())
    alive.mkdir()                                             # a running worker's: kept
    own = worker_dir(settings)
    assert own == base / str(os.getpid()) and own.is_dir() and not any(own.iterdir())
    assert not (base / dead).exists() and alive.exists()


def test_an_unhealthy_worker_out_of_device_memory_is_told_to_give_decoding_less() -> None:
    """gpu51: "restart it once the device is fixed" of a worker that ran out of GPU memory: a
    restart as it was runs out again (the same budget)."""
    import torch

    h = TargetHealth(limit=1)
    assert h.failed(RuntimeError("CUDA error: an illegal memory access\nwas encountered"))
    assert h.remedy == "restart it once the device is fixed" and "\n" not in h.last_error
    h.ok()
    assert h.failed(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # the CLI's wording (errors.OUT_OF_MEMORY_ADVICE): one text, --max-memory named as `specbatch worker` takes it
    assert h.remedy == ("out of device memory: give decoding less with --max-memory (SPECBATCH_MAX_MEMORY; "
                        "default 80% of the GPU memory free after loading) or a smaller --batch-size, then restart it")
