"""Tensors that meet on a GPU are on the same device, checked on CPU: the "meta" device stands in
for the GPU and ``SameDevice`` refuses an operation whose tensors live on two devices, as CUDA
does (torch itself lets meta and CPU tensors mix). Only code that reads no values back (no
``.tolist()``) runs on meta tensors."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from specbatch.engine.grammar import refuse

# what CUDA accepts across devices: moves, and a CPU index into a CUDA tensor
_MOVES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.__getitem__,
          torch.Tensor.__setitem__}


class SameDevice(TorchFunctionMode):
    """Raises where an operation's tensors (0-dim ones aside: CUDA takes CPU scalars) are on
    two devices."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MOVES:
            devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()}
            if len(devices) > 1:
                raise RuntimeError(f"{getattr(func, '__name__', func)}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def test_the_checker_refuses_what_cuda_refuses():
    with SameDevice(), pytest.raises(RuntimeError, match="masked_fill_"):
        torch.zeros(3, device="meta").masked_fill_(torch.tensor([True, False, True]), 0.0)


def test_a_cpu_grammar_mask_refuses_tokens_of_gpu_logits():
    """llguidance fills masks in CPU memory; the draft's and the target's logits are on the GPU.
    The drafter masked a GPU logit row with the CPU mask in place (a device error on the first
    structured row a model draft proposed for); ``refuse`` moves the mask first."""
    mask = torch.tensor([True, False, True])       # the grammar's, CPU, V = 3
    with SameDevice():
        row = torch.zeros(5, device="meta")          # logits wider than the vocabulary
        refuse(row, mask)
        refuse(torch.zeros(2, 5, device="meta"), torch.stack([mask, mask]))   # a tree's nodes
    # the values, on CPU: refused tokens and the columns past the vocabulary are -inf
    row = torch.zeros(5)
    refuse(row, mask)
    assert row.tolist() == [0.0, float("-inf"), 0.0, float("-inf"), float("-inf")]


def test_the_memory_budget_reads_the_gpu_for_a_device_named_by_index(monkeypatch):
    """``measure`` and ``default_budget`` read CUDA's allocator for "cuda:N" too, not the process's
    resident set and free RAM (the name with its index read as another device type)."""
    from specbatch.engine.memory import GPU_SHARE, default_budget, is_cuda, measure

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 123)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (1000, 4000))
    for dev in ("cuda", "cuda:1", torch.device("cuda", 1)):
        assert is_cuda(dev)
        assert measure(dev) == 123
        assert default_budget(dev) == int(1000 * GPU_SHARE)
    assert not is_cuda("cpu") and not is_cuda(torch.device("cpu"))
