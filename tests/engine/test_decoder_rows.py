"""Row order in the batch (engine/decoder.py)."""

from specbatch.engine.decoder import _refill


def test_rows_leaving_are_replaced_by_the_last_rows_staying():
    assert _refill([True, True, False, True, False, True]) == [0, 1, 5, 3]
    assert _refill([False, True, True]) == [2, 1]
    assert _refill([True, True]) == [0, 1]
    assert _refill([False, False]) == []
