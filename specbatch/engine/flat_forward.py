"""A decoder forward without transformers' module machinery, operator for operator the same.

At the decode loop's few rows a forward of the default target spends 3-5 ms of 40-50 (2-core
AMD EPYC, 1-16 rows: what this saves) in Python around its operators: ~420 module calls through ``nn.Module.__call__``,
transformers' decorators and keyword plumbing on every layer, the shared q/k/v and gate/up products
handed out member by member (docs/DESIGN.md, "The flat forward"). This walks the same layers in
one loop and calls the same operators on the same operands in the same order as
``modeling_llama`` / ``modeling_mistral`` / ``modeling_qwen2`` / ``modeling_qwen3`` (transformers
5.x): the embedding, the mask transformers' own ``create_causal_mask`` makes, the rotary module,
Qwen3's per-head query and key norms, RMSNorm's six operators with its casts, the
attention function the model is configured with (engine/attention.py's), the KV cache's
``update``, the MLP, the head over the kept positions. So every output is bitwise transformers'
(tests/engine/test_flat_forward.py compares them on each path the engine takes: a prefill, a
step, a verify's tree mask, holes, packed and plain Linears, int8, bfloat16), and a target
decoded through it is the same target.

What it serves is narrow on purpose (``FlatForward.of``, ``serves``): transformers' own classes (not
same-named ones of remote code) of Llama, Mistral, Qwen2 and Qwen3 without sliding-window layers, each module on its
class's forward, in eval mode with autograd
off, asked for logits only. Forward pre-hooks on the model and its layers (``specbatch run``'s
stop check, worker/interrupt.py) run as ``nn.Module.__call__`` would run them; any other hook, a
hook that returns new inputs, or any other keyword sends the call to transformers' forward.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.llama.modeling_llama import rotate_half

from specbatch.engine.packed import sibling_outputs

# the transformers modules whose classes' forwards this reproduces, by model type, and their prefix
_MODULES = {"llama": ("transformers.models.llama.modeling_llama", "Llama"),
            "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
            "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
            "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3")}
_KWARGS = frozenset({"attention_mask", "position_ids", "logits_to_keep"})


class FlatForward:
    """The flat forward of one causal LM (``of``); call it as ``model(input_ids=..., cache=...,
    use_cache=True, **kwargs)`` would be called, where ``serves(kwargs)``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        base = model.model
        self.layers = list(base.layers[: base.config.num_hidden_layers])
        # each layer's modules, looked up once: nn.Module's attribute look-up is ~1 us a name, 26
        # names a layer (``of`` checked their classes; a module swapped in later is not seen)
        self._plans = [_Plan.of(layer, base.config.model_type) for layer in self.layers]
        # the modules whose hooks are not run here: a hook on any of them sends a call to transformers
        ran = {id(model), *map(id, self.layers)}
        self._hookless = [m for m in model.modules() if id(m) not in ran]
        self._eager_attention: Callable[..., Any] = sys.modules[type(self.layers[0].self_attn).__module__] \
            .eager_attention_forward

    @classmethod
    def of(cls, model: Any) -> FlatForward | None:
        """The flat forward of ``model`` where its modules are transformers' own ones this reproduces
        (the classes themselves: remote code may name its own classes alike), each with its class's
        forward, else None."""
        where = _MODULES.get(getattr(getattr(model, "config", None), "model_type", ""))
        if where is None:
            return None
        source, prefix = where
        module = importlib.import_module(source)     # (remote code of this model_type may not have)
        causal_lm, decoder, layer_cls, attention, mlp, norm = (getattr(module, prefix + n) for n in (
            "ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm"))
        if type(model) is not causal_lm:
            return None
        base = model.model
        # a sliding window takes another mask: Qwen2/3 per layer (``layer_types``), Mistral for all
        # layers where its config sets one
        if type(base) is not decoder or getattr(base, "has_sliding_layers", False) or type(base.norm) is not norm \
                or (prefix == "Mistral" and getattr(model.config, "sliding_window", None) is not None):
            return None
        parts = [model, base, base.norm]
        for layer in base.layers:
            mine = (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
            # Qwen3 normalizes each head's query and key (q_norm, k_norm) before the rotation
            heads = tuple(getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if hasattr(layer.self_attn, n))
            if tuple(map(type, mine + heads)) != (layer_cls, attention, mlp, norm, norm) + (norm,) * len(heads) \
                    or len(heads) != (2 if prefix == "Qwen3" else 0):
                return None
            parts += mine + heads
        return cls(model) if all(map(_own_forward, parts)) else None

    def serves(self, kwargs: dict[str, Any]) -> bool:
        """Whether a call with these keywords (beside the input ids and cache) is served here."""
        if not _KWARGS.issuperset(kwargs) or self.model.training or torch.is_grad_enabled() \
                or torch.compiler.is_compiling():
            return False
        if _has_global_hooks() or _hooked(self.model, after=True) or any(_hooked(m, after=True) for m in self.layers):
            return False
        return not any((m._forward_hooks and _live(m._forward_hooks)) or m._forward_pre_hooks for m in self._hookless)

    def __call__(self, input_ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> Any:
        """input_ids (B, T) -> logits (B, kept, V) in a ``CausalLMOutputWithPast``; appends to ``cache``.
        Call under inference mode or ``no_grad``, where ``serves``."""
        model = self.model
        _pre_hooks(model, ())
        base = model.model
        config = base.config
        h = base.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(h.shape[1], device=h.device) + cache.get_seq_length()).unsqueeze(0)
        mask = create_causal_mask(config=config, inputs_embeds=h, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = base.rotary_emb(h, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, self._eager_attention)
        extra = {"position_ids": position_ids, "use_cache": True}
        for plan in self._plans:
            if plan.layer._forward_pre_hooks:
                _pre_hooks(plan.layer, (h,))
            h = _layer(plan, h, mask, cos, sin, cache, attention, extra)
        h = _norm(base.norm, h)
        return CausalLMOutputWithPast(logits=model.lm_head.forward(slice_logits_to_keep(h, logits_to_keep)))


class _Plan(NamedTuple):
    """One decoder layer's modules and constants, as its forwards read them."""

    layer: Any
    attn: Any
    in_norm: Any
    post_norm: Any
    qkv: tuple[Any, Any, Any]
    qk_norms: tuple[Any, Any] | None       # Qwen3's per-head query and key norms
    o_proj: Any
    gate_up: tuple[Any, Any]
    down_proj: Any
    act: Any
    head_dim: int
    layer_idx: int
    scaling: float
    # the sliding_window keyword its attention passes the attention function (Qwen2/3: the
    # layer's, None on full-attention layers; Mistral: its config's, None where served; Llama: none)
    window: dict[str, Any]

    @classmethod
    def of(cls, layer: Any, model_type: str) -> _Plan:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        window = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else \
            {"sliding_window": None} if model_type == "mistral" else {}
        return cls(layer, attn, layer.input_layernorm, layer.post_attention_layernorm,
                   (attn.q_proj, attn.k_proj, attn.v_proj), norms, attn.o_proj, (mlp.gate_proj, mlp.up_proj),
                   mlp.down_proj, mlp.act_fn, attn.head_dim, attn.layer_idx, attn.scaling, window)


def _layer(p: _Plan, h: torch.Tensor, mask: Any, cos: torch.Tensor, sin: torch.Tensor, cache: Any,
           attention: Callable[..., Any], extra: dict[str, Any]) -> torch.Tensor:
    """One decoder layer: ``LlamaDecoderLayer.forward`` / ``LlamaAttention.forward`` (Qwen3's:
    ``q_norm`` / ``k_norm`` on each head first) / ``LlamaMLP.forward``."""
    shape = (*h.shape[:-1], -1, p.head_dim)
    # attention: q, k, v (B, heads, T, D), rotated, the cache's keys and values, the configured function
    q, k, v = (y.view(shape) for y in sibling_outputs(p.qkv, _norm(p.in_norm, h)))
    if p.qk_norms is not None:
        q, k = _norm(p.qk_norms[0], q), _norm(p.qk_norms[1], k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    k, v = cache.update(k, v, p.layer_idx, kwargs=extra)
    out, _ = attention(p.attn, q, k, v, mask, dropout=0.0, scaling=p.scaling, **p.window, **extra)
    h = h + p.o_proj.forward(out.reshape(*shape[:-2], -1).contiguous())
    # MLP
    gate, up = sibling_outputs(p.gate_up, _norm(p.post_norm, h))
    return h + p.down_proj.forward(p.act(gate) * up)


def _norm(norm: Any, h: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, its casts included (no-ops in float32, not in bfloat16)."""
    dtype = h.dtype
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _own_forward(m: torch.nn.Module) -> bool:
    """Whether ``m`` runs its class's forward: none set on the module itself (accelerate's hooks wrap
    it so), or the one ``hub_kernels.unroute_hub_kernels`` sets, the class's unwrapped."""
    mine = vars(m).get("forward")
    if mine is None:
        return True
    cls = type(m).forward
    func = getattr(mine, "__func__", None)
    return func is not None and (func is cls or func is getattr(cls, "__wrapped__", None))


def _has_global_hooks() -> bool:
    from torch.nn.modules import module as m
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_forward_hooks_always_called
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def _hooked(m: torch.nn.Module, *, after: bool) -> bool:
    """Hooks ``_pre_hooks`` does not run: forward hooks, and pre-hooks that take keywords."""
    return bool((after and (_live(m._forward_hooks) or m._backward_hooks or m._backward_pre_hooks))
                or m._forward_pre_hooks_with_kwargs)


def _live(hooks: dict[int, Any]) -> bool:
    """Whether any of these forward hooks does something here. transformers' output-capturing
    hooks (utils/output_capturing.py), installed on the layers for good by the first forward asked
    for hidden states (a drafter that reads the target's), record only while that forward's
    collector is set, which no call of the flat forward is inside: skipping them skips nothing."""
    return any(getattr(h, "__name__", "") != "output_capturing_hook"
               or getattr(h, "__module__", "") != "transformers.utils.output_capturing" for h in hooks.values())


def _pre_hooks(m: torch.nn.Module, args: tuple[Any, ...]) -> None:
    """Run ``m``'s forward pre-hooks as ``nn.Module.__call__`` does. They are checks (a stop
    request, a count): one that returns new inputs is a bug here, not an input to honour halfway."""
    for hook in tuple(m._forward_pre_hooks.values()):
        if hook(m, args) is not None:
            raise RuntimeError(f"a forward pre-hook of {type(m).__name__} returned new inputs: "
                               "the flat forward runs pre-hooks that only check")
