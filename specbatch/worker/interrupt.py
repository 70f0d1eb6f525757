"""Stopping ``specbatch run`` cleanly on Ctrl-C (SIGINT) or SIGTERM.

First signal: a stop is requested. The engine stops at its next decode step (a forward pre-hook
on the target model raises ``Interrupted``; the engine itself knows nothing of it), results
already written stay, the claimed requests are released, the job is marked interrupted.
Second signal: ``KeyboardInterrupt`` at once: the decode is abandoned mid-step, the claimed
requests are still released and the job marked interrupted (one transaction, ``run_embedded``).
Nothing is lost even where a third signal cuts that short: the requests still claimed carry this
process's lease, and ``resume`` takes back the leases of a dead ``specbatch run`` process on this
host at once instead of waiting for them to expire.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Interrupted(Exception):
    """A stop was requested; raised inside the engine at its next step."""


class StopRequest:
    """Set by the first signal; ``check()`` raises Interrupted once set."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals = 0

    def __call__(self) -> bool:          # usable as process_chunk's ``should_stop``
        return self.event.is_set()

    def check(self) -> None:
        if self.event.is_set():
            raise Interrupted("stop requested")


@contextmanager
def stop_on_signals(on_first: Callable[[], None] | None = None) -> Iterator[StopRequest]:
    """Install SIGINT/SIGTERM handlers for the block (main thread only); restore them after."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        stop.signals += 1
        if stop.signals > 1:
            raise KeyboardInterrupt
        stop.event.set()
        if on_first is not None:
            on_first()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def interruptible(engine: Any, stop: StopRequest) -> Iterator[None]:
    """Make ``engine`` raise Interrupted at its next layer once ``stop`` is set.

    Every model it runs is checked, the draft models too: between two target forwards a batch's
    drafts prefill joining rows, catch up and propose several tokens each, seconds on a busy CPU
    at batch 16-24 (docs/CONTRACTS.md, "cancel"). And each decoder layer is checked, not only
    the whole forward, so a long prefill is cut short too: the decode is abandoned, its caches
    with it, so a forward stopped halfway leaves nothing behind. A check is one Event look-up."""
    import torch

    handles = []
    for lm in (getattr(engine, "target", None), *(getattr(engine, "drafts", None) or ())):
        model = getattr(lm, "model", None)
        if not isinstance(model, torch.nn.Module):
            continue
        layers = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
        handles += [m.register_forward_pre_hook(lambda *_: stop.check()) for m in (model, *layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
