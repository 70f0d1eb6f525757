"""Counts in messages: ``plural(1, "request")`` is "1 request", ``plural(2, "request")`` "2 requests".

A top-level module, like redact.py, because messages are worded in every layer (engine errors,
stored failure reasons, CLI lines) and none of them may import another's helpers.
"""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural (``many``, else noun + "s") unless n is 1."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"
