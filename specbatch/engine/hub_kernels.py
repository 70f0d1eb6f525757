"""Modules' forwards without the ``kernels`` package's per-call routing, which is not thread-safe
under dynamo.

With ``kernels`` installed (transformers 5.25 requires it), transformers decorates some layers with
``use_kernelized_func`` (``LlamaAttention``: ``apply_rotary_pos_emb``). Each call of such a layer
then runs ``new_forward`` (kernels/_internals/layer/layer.py), which reads and sets
``_ACTIVE_KERNEL_FUNCS``: a ``CompileableContextVar`` that is a ``ContextVar`` in eager code but,
once code under ``torch.compile`` has set it, a process-wide global (``global_var`` plus the flag
``uses_global_var``) that eager code on every thread reads and writes too. Compiling in the
background (``engine/background.py``) runs dynamo on one thread while another decodes eagerly
through the same modules: the compiling thread's frames flag the global, the decoding thread then
writes it, and dynamo's guards on it fail mid-trace ("Guard failed on the same frame it was
created ... _ACTIVE_KERNEL_FUNCS.global_var is None", "SpeculationLog diverged"): every
background compile fell back to eager.

The routing only matters after ``kernels.kernelize`` swaps in a hub kernel, which specbatch never
calls: without it ``new_forward`` ends in the layer's own forward and the routed function in its
own Python body. So each such module gets its class's undecorated forward (``__wrapped__``, kept
by ``functools.wraps``) as its own: nothing sets ``_ACTIVE_KERNEL_FUNCS`` any more, its value stays
None on every thread, and the outputs are the same (tests/engine/test_hub_kernels.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _kernel_routed(forward: Any) -> bool:
    """Whether ``forward`` is the wrapper ``kernels.use_kernelized_func`` put on a layer's class."""
    code = getattr(forward, "__code__", None)
    return (code is not None and code.co_name == "new_forward" and hasattr(forward, "__wrapped__")
            and "_ACTIVE_KERNEL_FUNCS" in getattr(forward, "__globals__", {}))


def unroute_hub_kernels(model: torch.nn.Module) -> int:
    """Give every submodule whose class forward is ``kernels``' routing wrapper the forward it wraps
    (an instance attribute: the class and other models are untouched); returns how many."""
    n = 0
    for module in model.modules():
        forward: Any = type(module).forward
        if _kernel_routed(forward):
            module.forward = types.MethodType(forward.__wrapped__, module)  # type: ignore[method-assign]
            n += 1
    return n
