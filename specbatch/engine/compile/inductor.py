"""Inductor's configuration: the one module that sets it (options, on-disk caches, dynamo limits).

``inductor_options`` is what a compiled forward's graphs are built with; ``compile_kwargs`` is
how ``CompiledForward`` asks ``torch.compile`` for them; ``configure_inductor`` sets the
process-wide flags before the first compile; ``use_cache_dir`` points inductor's on-disk caches
at a directory and is the only environment write here, made by the edge that owns the process
(a CLI command, a worker) when it asks for it.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

# Where the frozen graphs do not fit, CPU compiles without freezing: the MKL linears read the
# eager weights (no copies: 1243 MiB resident for the default target's 2 graphs, against about
# 1900 frozen), the FX graph cache works, compiling is faster; it loses inductor's C++ GEMM, which
# on one host made a verify nearly free and on another measured no faster (docs/COMPILE.md)
NOT_FROZEN = {"freezing": False, "max_autotune": False}

_lock = threading.Lock()


def inductor_cache_dir(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / "inductor"


def inductor_options(device: torch.device | str) -> dict[str, Any]:
    """What inductor is told beyond its defaults, per device type.

    CPU: inductor's own C++ micro-GEMM kernels (max-autotune, chosen per linear against
    oneDNN/MKL) stream each weight once for all M rows, which is what makes a verify of k tokens
    cost about one step; the frozen oneDNN linears alone measured no faster than eager at M=1
    (docs/COMPILE.md).
    """
    options: dict[str, Any] = {"freezing": True}  # weights become constants: packed GEMMs, folded ops
    if torch.device(device).type == "cpu":
        options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    return options


def compile_kwargs(device: torch.device, frozen: bool, dynamic: bool = True) -> dict[str, Any]:
    """``torch.compile`` keywords for a model's forward on ``device``, frozen or not (CPU).

    CUDA: CUDA graphs remove the per-kernel launch cost that dominates small batches; with the
    cache length symbolic a graph would be re-recorded at every new length, so
    ``configure_inductor`` tells inductor to skip them for dynamic graphs (Triton kernels still
    fuse). Not frozen, the options patch inductor's config for this compile only. ``dynamic=False``
    (the static-cache backend's classes): sizes are fixed but for those the caller marks dynamic
    (``torch._dynamo.mark_dynamic``), and no size becomes dynamic because another class ran."""
    if frozen:
        return {"dynamic": dynamic, "mode": "reduce-overhead" if device.type == "cuda" else None}
    return {"dynamic": dynamic, "options": dict(NOT_FROZEN)}


def use_cache_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Point inductor's on-disk caches (kernels, autotuning, FX graphs) at ``<cache_dir>/inductor``,
    shared by every process given the same directory; returns that path.

    Torch 2.13 takes the location from ``TORCHINDUCTOR_CACHE_DIR`` only (``torch._inductor.runtime.
    cache_dir_utils.cache_dir``; ``torch._inductor.config`` has no setting for it), so this sets
    that variable, for this process and the ones it starts. Called by the edges that own the
    process (``specbatch`` commands that decode, the worker) before the first compile; the value
    comes from the settings. Not called: inductor caches under its default temporary directory,
    and the warm-up records (``record``) still live under ``cache_dir``.
    """
    path = inductor_cache_dir(cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def configure_inductor(device: torch.device | str = "cpu") -> None:
    """Set inductor's process-wide flags before the first compile: ``inductor_options``, quiet
    autotuning, its on-disk caches on, and room for every graph this process compiles."""
    import torch._inductor.config as ic

    with _lock:
        for name, value in inductor_options(device).items():
            setattr(ic, name, value)
        if torch.device(device).type == "cuda":   # see compile_kwargs
            ic.triton.cudagraph_skip_dynamic_graphs = True
        if ic.max_autotune:   # its per-GEMM timing tables go to stderr: not a user's business
            import torch._inductor.select_algorithm as sa

            ic.max_autotune_report_choices_stats = False
            sa.PRINT_AUTOTUNE = False
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                                    module="torch._inductor")
        ic.fx_graph_cache = True        # compiled graphs reused by later processes
        ic.autotune_local_cache = True
        torch._functorch.config.enable_autograd_cache = True  # type: ignore[attr-defined]
        # every graph of every model this process compiles (targets, drafts, their shape variants)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


def defaults() -> Any:
    """A context in which inductor runs as users of ``torch.compile`` get it (a baseline that
    compiles its own way, e.g. HF's static-cache path): what ``configure_inductor`` set
    process-wide for the compiled forward undone for its duration, CUDA graphs included."""
    import torch._inductor.config as ic

    return ic.patch({"freezing": False, "max_autotune": False, "triton.cudagraph_skip_dynamic_graphs": False})
