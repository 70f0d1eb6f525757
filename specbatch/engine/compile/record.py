"""The on-disk record of each warm-up: what it cost, what each graph measured against eager here,
and the frozen / not-frozen comparison, kept beside inductor's caches under ``cache_dir``, so a
later start knows whether it hits the cache, how long compiling takes and what it buys here."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specbatch.engine.compile.forward import ModelHandle, key_class, shape_class
from specbatch.engine.compile.inductor import inductor_cache_dir, inductor_options
from specbatch.engine.fingerprint import processor


@dataclass
class CompileReport:
    """What compiling a model cost and whether it worked (errors as data)."""

    model: str
    enabled: bool = False
    seconds: float = 0.0                      # warm-up wall time, all graphs
    graphs: dict[str, float] = field(default_factory=dict)   # shape -> seconds of its first call
    frozen: bool | None = None                # weights frozen into the graphs (see NOT_FROZEN)
    speedups: dict[str, float] = field(default_factory=dict)  # shape -> eager / compiled step time here
    eager_shapes: list[str] = field(default_factory=list)     # shapes auto left eager (no gain here)
    frozen_gain: dict[str, float] = field(default_factory=dict)  # shape -> not-frozen / frozen step time
    cached: bool = False                      # a previous process had warmed the same graphs up
    first_start_seconds: float | None = None  # the first (uncached) start's warm-up, as recorded
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "enabled": self.enabled, "seconds": round(self.seconds, 2),
                "graphs": {k: round(v, 2) for k, v in self.graphs.items()},
                "frozen": self.frozen, "speedups": {k: round(v, 3) for k, v in self.speedups.items()},
                "eager_shapes": self.eager_shapes, "cached": self.cached,
                "frozen_gain": {k: round(v, 3) for k, v in self.frozen_gain.items()},
                "first_start_seconds": None if self.first_start_seconds is None
                else round(self.first_start_seconds, 2), "error": self.error}


def host_key(device: torch.device | str) -> str:
    """The machine a measurement was made on, as far as it decides what compiling buys: the
    processor model and its core count (CPU) or the GPU's name. Four 2-core hosts measured 1.17x
    to 1.84x with the same code (docs/COMPILE.md, "Measured on each host"), so a record one host
    wrote in a shared cache directory must not decide for another. Not the host name: a
    container gets a new one at every start, and its measurements would be lost each time."""
    device = torch.device(device)
    name = processor(device.type, device.index)
    tag = "".join(c if c.isalnum() else "_" for c in f"{platform.machine()}-{device.type}")
    return f"{tag}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"


def marker(cache_dir: str | os.PathLike[str], lm: ModelHandle, frozen: bool = True, static: bool = False) -> Path:
    """Where the record of ``lm``'s warm-up (frozen or not; the compiled forward's or, ``static``,
    the static-cache backend's classes, engine/compile/static.py) on this host (``host_key``) lives
    under ``cache_dir``."""
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{lm.name}-{lm.info.get('source', '')}")
    # graphs compiled with other inductor options are not these (nor are their times and ratios)
    tag = "-".join(f"{v}" for k, v in sorted(inductor_options(lm.device).items()) if k != "freezing")
    tag = "".join(c if c.isalnum() else "_" for c in tag) or "default"
    if not frozen and torch.device(lm.device).type == "cpu":
        tag = "not_frozen"
    if static:
        tag = f"static-{tag}"
    host = host_key(lm.device)
    return inductor_cache_dir(cache_dir) / "specbatch-warm" / f"{key[-120:]}-{torch.__version__}-{tag}-{host}.json"


def write_marker(path: Path, report: CompileReport) -> float:
    """Record this warm-up; returns the first start's seconds. Kept from the record before: that
    first start's time (what a cold machine pays) and the frozen / not-frozen comparison (what
    every later start follows, ``recorded_frozen_gain``), which only a first start measures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    data = report.to_dict()
    first = report.seconds
    try:
        before = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        before = {}
    before = before if isinstance(before, dict) else {}
    if not data["frozen_gain"] and isinstance(before.get("frozen_gain"), dict):
        data["frozen_gain"] = before["frozen_gain"]
    try:
        first = float(before.get("first_start_seconds") or first)
    except (TypeError, ValueError):
        pass
    data["first_start_seconds"] = first
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return first


def is_cached(lm: ModelHandle, cache_dir: str | os.PathLike[str], frozen: bool = True) -> bool:
    """Whether a previous process warmed this model's compiled graphs up under ``cache_dir``."""
    return marker(cache_dir, lm, frozen).exists()


def _recorded(lm: ModelHandle, cache_dir: str | os.PathLike[str], frozen: bool = True) -> dict[str, Any]:
    try:
        data = json.loads(marker(cache_dir, lm, frozen).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_seconds(lm: ModelHandle, cache_dir: str | os.PathLike[str], frozen: bool = True,
                     n_graphs: int | None = None) -> float | None:
    """The last warm-up time of this model here (a cached start), when one was recorded; with
    ``n_graphs``, scaled to that many graphs (a bench warmed 4, a single-row start needs 2)."""
    record = _recorded(lm, cache_dir, frozen)
    try:
        seconds = float(record["seconds"])
    except (KeyError, TypeError, ValueError):
        return None
    warmed = record.get("graphs")
    if n_graphs is not None and isinstance(warmed, dict) and warmed:
        seconds *= n_graphs / len(warmed)
    return seconds


def recorded_frozen_gain(lm: ModelHandle, cache_dir: str | os.PathLike[str],
                         shapes: Iterable[tuple[int, int, int]] = ()) -> dict[str, float] | None:
    """Not-frozen / frozen step time per shape, as the start here that compared them measured
    (``compare_not_frozen``); None when no start here compared them, or compared none of some
    shape class in ``shapes`` (a batch-1 start's comparison does not decide for batched graphs)."""
    gain = _recorded(lm, cache_dir, True).get("frozen_gain")
    if not isinstance(gain, dict) or not gain:
        return None
    try:
        gain = {str(k): float(v) for k, v in gain.items()}
        if not {shape_class(r, w) for r, w, _ in shapes} <= {key_class(k) for k in gain}:
            return None
    except (TypeError, ValueError):     # a record written by other code: not a measurement
        return None
    return gain


def recorded_speedup(lm: ModelHandle, cache_dir: str | os.PathLike[str], rows: int,
                     frozen: bool = True) -> float | None:
    """What the last warm-up here measured for one-token steps of ``rows`` rows' class (plain
    decoding, most of a job's steps), when it measured it."""
    for key, value in (_recorded(lm, cache_dir, frozen).get("speedups") or {}).items():
        try:
            if key_class(key) == shape_class(rows, 1):
                return float(value)
        except (TypeError, ValueError):   # a record written by other code: not a measurement
            continue
    return None
