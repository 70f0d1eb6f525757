"""Timing device work: the one way specbatch reads the clock around a forward.

CUDA (and MPS) kernels run asynchronously: a forward returns once its kernels are queued, so
``perf_counter`` around it measures the launches, not the work, and the work lands in whatever is
timed next. The autopilot, the gamma controller and compile's auto decision choose by measured
seconds, so on a GPU they would choose by launch overhead. ``now(device)`` waits for the device's
queue first; on CPU it is ``perf_counter`` and costs nothing more.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def synchronize(device: Any) -> None:
    """Wait until the work queued on ``device`` (a torch.device or its name) has run; no-op on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def now(device: Any) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done: take it at both ends of
    an interval of device work."""
    synchronize(device)
    return time.perf_counter()
