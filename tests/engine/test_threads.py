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
def test_omp_num_threads_is_read_as_openmp_reads_it(value, expected) -> None:
    assert threads.omp_threads(value) == expected


def test_omp_num_threads_caps_the_default_and_the_flag_comes_first(unset) -> None:
    """A scheduler's or shell profile's OMP_NUM_THREADS was ignored: the default planned from the cores."""
    unset.setenv("OMP_NUM_THREADS", "3")
    assert threads.configure_threads(None) == 3 and torch.get_num_threads() == 3
    # below the cap it is still the default: the governor may lower it while other processes hold cores
    assert threads._SET[0] == threads.Plan(3, 1, 3, True, cap=3) and threads.adaptable_threads() == 3

    unset.setattr(threads, "_SET", [])
    assert threads.configure_threads(5) == 5 and not threads._SET[0].default   # --threads comes first

    unset.setattr(threads, "_SET", [])
    unset.setenv("OMP_NUM_THREADS", "1")
    assert threads.configure_threads(None) == 1 and threads.adaptable_threads() == 0


def test_omp_num_threads_never_adds_threads_to_the_default(unset) -> None:
    """review50: taken as a count, OMP_NUM_THREADS=8 with 4 local workers on 8 cores gave each 8
    (32 threads), each of --processes 2 and of 2 lanes 8; a typo's 100000 aborted in libgomp."""
    unset.setenv("OMP_NUM_THREADS", "8")
    assert threads.configure_threads(None, local_workers=4) == 2
    unset.setattr(threads, "_SET", [])
    assert threads.configure_threads(None, lanes=2) == 4 and threads._SET[0].lanes == 2
    unset.setattr(threads, "_SET", [])
    assert threads.configure_threads(None, processes=2) == 1 and threads._SET[0].forked == 4
    unset.setattr(threads, "_SET", [])
    unset.setenv("OMP_NUM_THREADS", "100000")
    assert threads.configure_threads(None) == 8 and torch.get_num_threads() == 8
    unset.setattr(threads, "_SET", [])
    unset.setenv("OMP_NUM_THREADS", "3")
    assert threads.configure_threads(None, lanes=2) == 3   # a cap on each lane's share (4), as on each process's


def test_a_parent_that_decodes_after_all_keeps_to_omp_num_threads(unset) -> None:
    """It took its planned children's threads (4 x 2 here) whatever OMP_NUM_THREADS said."""
    unset.setenv("OMP_NUM_THREADS", "2")
    threads.configure_threads(None, processes=4)
    threads.decode_here(4)
    assert torch.get_num_threads() == 2 and threads._SET[0].threads == 2
    unset.setattr(threads, "_SET", [])
    threads.configure_threads(3, processes=2)    # --threads fixes each process's count: both taken
    threads.decode_here(2)
    assert torch.get_num_threads() == 6


def test_without_omp_num_threads_the_default_is_the_cores_and_governed(unset) -> None:
    assert threads.configure_threads(None, local_workers=2) == 4
    assert threads._SET[0].default and threads.adaptable_threads() == 4


def test_the_thread_count_and_where_it_came_from_are_logged(unset, caplog) -> None:
    """qa50w: nothing said how many threads a worker decodes on, or that OMP_NUM_THREADS capped them."""
    unset.setenv("OMP_NUM_THREADS", "1")
    with caplog.at_level("INFO", logger="specbatch.engine.threads"):
        threads.configure_threads(None, local_workers=2)
        unset.setattr(threads, "_SET", [])
        unset.setenv("OMP_NUM_THREADS", "abc")
        threads.configure_threads(None, lanes=2)
    assert [r.getMessage() for r in caplog.records] == [
        "torch threads: 1 (8 usable cores / 2 local worker(s), at most OMP_NUM_THREADS=1)",
        "torch threads: 4 in each lane (8 usable cores / 1 local worker(s) / 2 lanes "
        "(OMP_NUM_THREADS='abc' is no positive integer: ignored))"]
