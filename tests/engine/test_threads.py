"""engine/threads.py: where a process's torch thread count comes from."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine import threads


@pytest.fixture
def unset(monkeypatch):
    """No thread count set in this process yet, 8 usable cores; torch's own count put back after."""
    monkeypatch.setattr(threads, "_SET", [])
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


@pytest.mark.parametrize("value, expected", [("3", 3), ("3,1", 3), (" 2 ", 2), ("", 0), ("0", 0),
                                             ("-2", 0), ("four", 0), ("²", 0), ("٣", 0)])
def test_omp_num_threads_is_read_as_openmp_reads_it(unset, value, expected) -> None:
    unset.setenv("OMP_NUM_THREADS", value)
    assert threads.omp_threads() == expected


def test_omp_num_threads_is_the_users_choice_after_the_flag(unset) -> None:
    unset.setenv("OMP_NUM_THREADS", "3")
    assert threads.configure_threads(None) == 3 and torch.get_num_threads() == 3
    # the user's count: the thread governor leaves it alone
    assert threads._SET[0] == threads.Plan(3, 1, 3, False) and threads.adaptable_threads() == 0

    unset.setattr(threads, "_SET", [])
    assert threads.configure_threads(2) == 2        # --threads / SPECBATCH_THREADS come first

    unset.setattr(threads, "_SET", [])
    unset.setenv("OMP_NUM_THREADS", "4")
    assert threads.configure_threads(0, lanes=2) == 4 and threads._SET[0].lanes == 2   # as --threads 4


def test_without_omp_num_threads_the_default_is_the_cores_and_governed(unset) -> None:
    assert threads.configure_threads(None, local_workers=2) == 4
    assert threads._SET[0].default and threads.adaptable_threads() == 4


def test_omp_num_threads_past_the_usable_cores_is_the_cores(unset) -> None:
    """review50: a profile's OMP_NUM_THREADS=16 under `taskset -c 0`, or a typo's 100000 (which
    aborted in libgomp), set that many threads; torch itself reads it as at most the cores."""
    unset.setenv("OMP_NUM_THREADS", "100000")
    assert threads.configure_threads(None) == 8 and torch.get_num_threads() == 8
    assert not threads._SET[0].default        # still the user's: the governor leaves it alone
