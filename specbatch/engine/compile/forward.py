"""The compiled forward: a model's forward through ``torch.compile``, normalized so every decode
call hits a warmed graph; eager for prefill, for shape classes that measured no faster, and after
a failure. ``install`` routes a loaded model's forward through it."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from specbatch.engine.compile.inductor import compile_kwargs
from specbatch.engine.hf_cache import contiguous_layers

logger = logging.getLogger(__name__)

# how dynamo's fail_on_recompile stance words a miss (torch is pinned; a unit test holds this)
MISS = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


class ModelHandle(Protocol):
    """What compiling needs of a loaded model (``specbatch.engine.loading.LoadedModel``)."""

    name: str
    model: Any                      # a transformers PreTrainedModel
    device: torch.device
    info: dict[str, Any]
    compiled: CompiledForward | None

    def forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any: ...


class Graphs:
    """What the compiled forwards share: the model through ``torch.compile`` (``inductor``'s
    options), calls after warm-up through the warmed graphs only (a call that misses them all runs
    eagerly, counted and warned about once), and a compiler failure: one warning, eager from then on."""

    dynamic = True   # the graphs' sizes are symbolic (CompiledForward) or fixed (StaticForward)

    def __init__(self, model: Any, name: str, device: torch.device, frozen: bool = True) -> None:
        self.model = model
        self.name = name
        self.device = device
        self.frozen = frozen or device.type != "cpu"
        self.failed: str | None = None
        self._fn = torch.compile(model, **compile_kwargs(device, self.frozen, dynamic=self.dynamic))
        # after warm_up, a call that fails every warmed graph's guards runs eagerly instead of
        # compiling for minutes; it is counted and warned about, never silent (docs/COMPILE.md)
        self.warmed = False
        self.calls = 0     # calls after warm-up
        self.misses = 0    # of those, how many missed every warmed graph and ran eagerly
        self.trial = False   # compiled only to be compared (``compare_not_frozen``)
        _forwards.add(self)

    def _served(self, inputs: dict[str, Any]) -> Any:
        """A call after warm-up: through a warmed graph, or eagerly (counted) when it misses them
        all. The stance is scoped to this call: nothing else in the process is affected."""
        self.calls += 1
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._fn(**inputs)
        except RuntimeError as e:   # raised by dynamo before the frame runs: the cache is untouched
            if not str(e).startswith(MISS):
                raise
            self.misses += 1
            if _first(f"miss {self.name}"):
                logger.warning("%s: a decode step matched no warmed compiled graph and ran eagerly (%s); "
                               "further misses are counted, not logged (specbatch_compiled_forward_misses)",
                               self.name, "; ".join(miss_reasons(e)[:3]) or "no guard reason given")
            return self.model(**inputs)

    def fail(self, error: BaseException) -> None:
        """Give up compiling this model: log one warning (per process), stay eager from now on.
        A trial (``compare_not_frozen``'s not-frozen graphs) only logs: the frozen ones serve."""
        self.failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}" \
            if str(error).strip() else type(error).__name__
        if self.trial:
            logger.info("%s: the not-frozen graphs failed to compile (%s); frozen ones serve", self.name, self.failed)
        elif _first("compile"):
            logger.warning("compiling %s failed, decoding eagerly instead (%s)", self.name, self.failed)


class CompiledForward(Graphs):
    """A model's forward through ``torch.compile`` over a ``DynamicCache``; eager for prefill and
    after a failure."""

    def __init__(self, model: Any, name: str, device: torch.device, frozen: bool = True) -> None:
        super().__init__(model, name, device, frozen)
        # shape classes (several rows?, several tokens?) whose graph measured no faster than eager
        # on this machine: auto sends them to the eager model (``prepare``)
        self.eager_classes: set[tuple[bool, bool]] = set()
        # the other variant (frozen or not) where a first start compared the two: its graphs stay
        # on the model's code object anyway (``compare_not_frozen``), so it stays servable
        self.alternative: CompiledForward | None = None

    def eligible(self, input_ids: torch.Tensor, n_cached: int) -> bool:
        # an empty cache is a prefill (long, once per request, eager GEMMs are fine there) and
        # takes the cache's lazy-initialization path, which would be one more graph
        return (self.failed is None and n_cached >= 2 and input_ids.dim() == 2
                and shape_class(*input_ids.shape) not in self.eager_classes)

    def __call__(self, input_ids: torch.Tensor, cache: Any, cache_kwarg: str, n_cached: int,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
        rows, width = input_ids.shape
        dev = input_ids.device
        contiguous_layers(cache)   # a crop's strided views would recompile the graphs
        # one signature for every call, as warmed up: a 4-D additive mask (a 2-D padding mask, the
        # dense path's, is folded into the causal one), position ids, contiguous inference tensors.
        # Anything else fails a guard of the warmed graphs (dispatch keys, stride 0 of an expanded
        # tensor), and after warm-up a miss runs eagerly: silently no faster (tests hold this)
        if attention_mask is None or attention_mask.dim() == 2:
            causal = causal_mask(rows, width, n_cached, self.model.dtype, dev)
            if attention_mask is not None:
                causal = causal.masked_fill(attention_mask[:, None, None, :] == 0,
                                            torch.finfo(self.model.dtype).min)
            attention_mask = causal
        if position_ids is None:
            position_ids = (n_cached + torch.arange(width, device=dev)).expand(rows, width)
        keep = width
        if isinstance(logits_to_keep, int):
            keep = width if logits_to_keep == 0 else min(logits_to_keep, width)
            # one kept logit would be a graph of its own (sizes 1 are specialized): keep two and
            # drop one here, one extra LM-head row costs next to nothing in a pre-packed GEMM
            logits_to_keep = torch.arange(width - max(keep, min(2, width)), width, device=dev)
        with torch.inference_mode():   # contiguous: an expanded (stride 0) input is a graph of its own
            input_ids, attention_mask, position_ids, logits_to_keep = (
                t.contiguous() if t.is_inference() else t.clone(memory_format=torch.contiguous_format)
                for t in (input_ids, attention_mask, position_ids, logits_to_keep))
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "logits_to_keep": logits_to_keep, "use_cache": True, cache_kwarg: cache, **kwargs}
        out = self._fn(**inputs) if not self.warmed else self._served(inputs)
        if out.logits.shape[1] != keep:
            out.logits = out.logits[:, -keep:]
        return out

_warned: set[str] = set()
_forwards: weakref.WeakSet[Graphs] = weakref.WeakSet()


def _first(key: str) -> bool:
    """True the first time ``key`` is seen in this process: one warning per key."""
    if key in _warned:
        return False
    _warned.add(key)
    return True


def miss_reasons(error: BaseException) -> list[str]:
    """The guard failures dynamo lists as "- ..." lines of its fail_on_recompile error."""
    return [ln.strip().lstrip("- ") for ln in str(error).splitlines() if ln.strip().startswith("- ")]


def forward_counts() -> dict[str, tuple[int, int]]:
    """Per model name: (calls after warm-up, of which missed every warmed graph and ran eagerly),
    over the compiled forwards alive in this process."""
    out: dict[str, tuple[int, int]] = {}
    for f in list(_forwards):
        calls, misses = out.get(f.name, (0, 0))
        out[f.name] = (calls + f.calls, misses + f.misses)
    return out


def causal_mask(rows: int, width: int, n_cached: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """(rows, 1, width, n_cached + width) additive mask: every cached column, causal on the new."""
    cols = torch.arange(n_cached + width, device=device)
    allowed = cols[None, :] <= (n_cached + torch.arange(width, device=device))[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].expand(rows, 1, width, n_cached + width)


class StaticForward(Graphs):
    """The static-cache backend's model call (engine/static_cache.py) through ``torch.compile``
    with fixed shapes: one graph per (slots, new tokens) class in ``classes``, every call already
    in the class's shape (S slots, W tokens, a 4-D additive mask over all C columns, every
    position's logits). ``columns`` None (CPU): the column count is dynamic (the backend marks
    it), so a class is one graph over every column bucket. Else (CUDA: CUDA graphs,
    ``reduce-overhead``, static in every size) every class is compiled and served at that one
    column capacity: a backend over these graphs keeps its buffers that wide, so a decode never
    leaves the warmed shape until a row outgrows it (then the calls miss, counted, and run
    eagerly). Classes outside ``classes`` run eagerly (the backend's own path)."""

    dynamic = False

    def __init__(self, model: Any, name: str, device: torch.device,
                 classes: Iterable[tuple[int, int]], frozen: bool = True, columns: int | None = None) -> None:
        super().__init__(model, name, device, frozen)
        self.classes = set(classes)
        self.columns = columns

    def eligible(self, slots: int, width: int) -> bool:
        return self.failed is None and (slots, width) in self.classes

    def __call__(self, inputs: dict[str, Any]) -> Any:
        return self._fn(**inputs) if not self.warmed else self._served(inputs)


def compilable(model: torch.nn.Module) -> str | None:
    """None when the model can be compiled here, else why not."""
    from specbatch.engine.int8 import RowInt8Linear, RowInt8Part

    # (fbgemm's packed weights are opaque to the compiler; torch.ao's dynamic Linear likewise)
    if any(isinstance(m, (RowInt8Linear, RowInt8Part)) or "quantized" in type(m).__module__ for m in model.modules()):
        return "dynamically quantized (int8) layers are not compiled"
    return None


def install(lm: ModelHandle, frozen: bool = True) -> CompiledForward | None:
    """Route ``lm.forward`` through a compiled forward (compiled lazily, see ``warm_up``)."""
    why = compilable(lm.model)
    if why is not None:
        logger.info("%s: not compiled: %s", lm.name, why)
        return None
    lm.compiled = CompiledForward(lm.model, lm.name, lm.device, frozen=frozen)
    return lm.compiled


def shape_class(rows: int, tokens: int) -> tuple[bool, bool]:
    """Which graph a call of ``rows`` x ``tokens`` runs (dynamo specializes sizes 1 apart)."""
    return rows > 1, tokens > 1


def shape_key(rows: int, tokens: int, keep: int) -> str:
    return f"{rows}x{tokens}:{keep}"


def rows_x_tokens(key: str) -> str:
    """A ``shape_key`` without its kept-logit count (internal): "16x4:2" -> "16x4"."""
    return key.split(":")[0]


def key_class(key: str) -> tuple[bool, bool]:
    """The shape class of a ``shape_key`` ("16x4:2"); ValueError for anything else."""
    rows, tokens = (int(x) for x in key.split(":")[0].split("x"))
    return shape_class(rows, tokens)
