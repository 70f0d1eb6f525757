"""Load a model and its tokenizer by known name, local directory or GGUF file.

A GGUF file is dequantized once and cached as safetensors under ``cache_dir`` so
later loads skip the dequantization. Nothing is downloaded at run time unless a
Hugging Face id is given and the hub is reachable.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specbatch.engine.flat_forward import FlatForward

from specbatch.device_names import DEVICE_HINT, DEVICE_NAME
from specbatch.engine import gguf_blocks
from specbatch.engine.compile.forward import CompiledForward
from specbatch.engine.gguf_once import parsed_once
from specbatch.engine.hf_cache import cache_kwarg, cache_length
from specbatch.engine.known_models import (
    KNOWN_MODELS,
    KnownModel,
    missing_weights,
    name_problem,
    not_same_tokenizer,
)
from specbatch.engine.model_files import POSITION_KEYS, gguf_cache_key
from specbatch.engine.packed import can_pack, pack_linears
from specbatch.errors import DeviceError, ModelLoadError
from specbatch.plural import plural

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with its tokenizer and stopping ids."""

    name: str
    model: PreTrainedModel             # eval mode
    tokenizer: Any
    device: torch.device
    eos_token_ids: frozenset[int]
    max_positions: int | None
    load_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    compiled: CompiledForward | None = None     # set by compile.forward.install
    # fingerprint.decoded_with's record and the compiled forward it was made for: every stored
    # result reads it, and making it walks the modules (0.26 ms on 32 layers). Its "compiled" is
    # not read from here: decoded_with sets it per call (the forward may fail, static graphs are
    # the engine's)
    decoded: tuple[CompiledForward | None, dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    # eager forwards go through engine/flat_forward.py where it serves them (transformers' numbers
    # with less Python); False: transformers' own forward always (tests compare the two)
    flat: bool = True
    # the flat forward of ``model`` (None: its architecture is not one it reproduces), made at the
    # first forward for the model this holds then: a copy given another model makes its own
    _flat: FlatForward | None = field(default=None, init=False, repr=False, compare=False)
    _flat_of: Any = field(default=None, init=False, repr=False, compare=False)

    def forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        """One forward with a KV cache (the cache keyword was renamed within transformers 5.x).

        Compiled when a compiled forward is installed and the cache is not empty; eager otherwise
        (and for good once compiling failed, after one warning): flat where it serves the call,
        else transformers' own, the same numbers either way.
        """
        kwarg = cache_kwarg(self.model)
        compiled = self.compiled
        if compiled is not None:
            n_cached = cache_length(cache)
            if compiled.eligible(input_ids, n_cached):
                try:
                    return compiled(input_ids, cache, kwarg, n_cached, **kwargs)
                except Exception as e:  # noqa: BLE001 - a compiler failure: warn once, go eager
                    if not is_compile_error(e):
                        raise
                    compiled.fail(e)
        flat = self.flat_forward() if self.flat else None
        if flat is not None and flat.serves(kwargs):
            return flat(input_ids, cache, **kwargs)
        return self.model(input_ids=input_ids, use_cache=True, **{kwarg: cache}, **kwargs)

    def flat_forward(self) -> FlatForward | None:
        """engine/flat_forward.py's forward of ``model``, where its architecture is one it reproduces."""
        if self._flat_of is not self.model:
            from specbatch.engine.flat_forward import FlatForward

            self._flat, self._flat_of = FlatForward.of(self.model), self.model
        return self._flat

    @property
    def compiled_live(self) -> bool:
        """A compiled forward is installed and has not failed: after a compiler failure the model
        decodes eagerly for good (``Graphs.fail``), and is laid out and scheduled as eager again."""
        return self.compiled is not None and getattr(self.compiled, "failed", None) is None

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)


def is_compile_error(e: BaseException) -> bool:
    """A failure of dynamo/inductor (or the C++ toolchain under it), not of the model's inputs."""
    mod = type(e).__module__
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "subprocess")) or \
        isinstance(e, (OSError, ImportError))


def known_model_status() -> list[dict[str, Any]]:
    """Every known model name and whether its weight packages are installed."""
    rows = []
    for m in KNOWN_MODELS.values():
        rows.append({"name": m.name, "description": m.description, "installed": missing_weights(m.name) is None,
                     "install": m.pip})
    return rows


def parse_device(device: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps`` as written; ValueError for anything else (whether
    the device is there is ``resolve_device``'s question)."""
    if not DEVICE_NAME.fullmatch(device.strip()):
        raise ValueError(f"unknown device {device!r}: {DEVICE_HINT}")
    return torch.device(device.strip())


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``; raises DeviceError when unknown or absent."""
    try:
        dev = parse_device(device)
    except ValueError as e:
        raise DeviceError(str(e)) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"device {device!r}: MPS is not available on this machine")
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise DeviceError(f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16") from None


def _package_dir(m: KnownModel, import_name: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:   # found by missing_weights, yet no package
        raise ModelLoadError(f"model {m.name!r}: its weights package {import_name} is not installed whole; "
                             f"reinstall it with: {m.pip}")
    return Path(next(iter(spec.submodule_search_locations)))


def _known_gguf(m: KnownModel, cache_dir: Path) -> Path:
    """Path of a known model's GGUF file, assembling package slices once (sha256 checked)."""
    problem = missing_weights(m.name)
    if problem is not None:
        raise ModelLoadError(problem)
    if len(m.packages) == 1:
        return _package_dir(m, m.packages[0]) / m.filename
    out = cache_dir / "gguf" / m.filename
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for pkg in m.packages:
            parts = sorted((_package_dir(m, pkg) / "data").glob("*.bin"))
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
    if m.sha256 and digest.hexdigest() != m.sha256:
        tmp.unlink()
        raise ModelLoadError(f"model {m.name!r}: assembled file has sha256 {digest.hexdigest()}, "
                             f"expected {m.sha256}; reinstall its packages")
    os.replace(tmp, out)  # atomic; a concurrent assembler wrote identical bytes
    return out


@dataclass(frozen=True)
class _Source:
    """Where a model's files are, and the fp32 model a first load just dequantized into them (kept:
    reading it back gives the same tensors, config and generation config; its tokenizer is read
    back, as a later load does, since the one converted from the GGUF keeps different init kwargs)."""

    path: Path
    fresh: Any = None     # a PreTrainedModel, eval mode, float32, on the CPU; None when cached already
    gguf: Path | None = None    # the GGUF file the files were dequantized from


def _dequantize_to_cache(gguf: Path, cache_dir: Path) -> _Source:
    """Dequantize a GGUF file once into a safetensors directory; returns that directory."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir / "dequantized" / gguf_cache_key(gguf)
    if (target / "model.safetensors").exists():
        _drop_quantization_config(target / "config.json")     # a cache written before this was fixed
        return _Source(target, gguf=gguf)
    logger.info("dequantizing %s into %s (once)", gguf, target)
    # a private temp dir per loader: workers starting together on a fresh cache don't collide
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        # the conversion keeps its own bar (once per machine, can be long); the file is parsed once
        with _hf_load(), parsed_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
            with contextlib.suppress(Exception):  # none: a later load reads the file for it
                gguf_blocks.write_index(gguf, tmp)  # while parsed: (at a load it costs as much again)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one readable error
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    _tie_missing_head(model)
    missing = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot read GGUF file {gguf}: no weights for {', '.join(missing[:3])}")
    tok.save_pretrained(tmp)
    _as_plain(model)
    model.config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    try:
        tmp.rename(target)
    except OSError:  # another loader finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    model.config._name_or_path = str(target)    # what from_pretrained(target) records
    return _Source(target, fresh=model.eval(), gguf=gguf)


def _as_plain(model: Any) -> None:
    """The dequantized model as what it is, plain tensors, and as a load of its cache gives it: without
    the GGUF file's ``quantization_config`` (see ``_drop_quantization_config``) and quantizer."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer


def _drop_quantization_config(config_json: Path) -> None:
    """Remove the GGUF file's ``quantization_config`` from a dequantized cache's config.json: its
    weights are plain tensors, but with it transformers reads the directory through its GGUF
    quantizer (``is_quantized``; in another dtype than float32 it warns the weights "stay
    quantized" and every matmul casts: not so). Rewritten atomically, as readers may be loading it;
    a cache this process cannot write is left as it is."""
    tmp = config_json.with_name(f"{config_json.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        config = json.loads(config_json.read_text())
        if "quantization_config" not in config:
            return
        del config["quantization_config"]
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config_json)
    except (OSError, ValueError) as e:   # (an unreadable config: from_pretrained says so itself)
        tmp.unlink(missing_ok=True)
        logger.info("cannot rewrite %s without its quantization_config: %s", config_json, e)


def _tie_missing_head(model: Any) -> None:
    """A GGUF file omits ``output.weight`` when the LM head is the token embedding (llama.cpp then
    reuses ``token_embd``); tie it here if the loader left the head unmaterialized (seen once in a
    full CI run: a (49152, 576) meta head on a cold cache, not reproduced alone)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or not head.weight.is_meta or embed.weight.is_meta:
        return
    if head.weight.shape == embed.weight.shape:
        head.weight = embed.weight
        model.config.get_text_config().tie_word_embeddings = True


def _quantize_int8(model: Any, device: torch.device, *, inplace: bool = False) -> Any:
    """``model`` with its Linear layers int8 (engine/int8.py: per-channel weights, per-row activation
    scales, so a row's logits do not depend on its batch): a copy, or ``model`` itself changed where
    ``inplace`` (a model nobody else holds: the copy would cost a fifth of the quantizing)."""
    if device.type != "cpu":
        logger.warning("int8 quantization is CPU-only; using the unquantized model on %s", device)
        return model
    from specbatch.engine.int8 import quantize_linears

    # torch.ao's quantize_dynamic took one activation scale per Linear input, coupling the rows of
    # a forward (issue 31); per-row scales agree more with the fp32 target too (docs/DESIGN.md)
    return quantize_linears(model if inplace else copy.deepcopy(model))


def _quantized_copy(model: Any, device: torch.device) -> Any:
    """``_quantize_int8(model)`` without copying the Linear weights it replaces: the copy shares
    them with ``model`` until quantizing swaps each Linear for an int8 one built from its weight, so
    the result holds none of them (a weight tied to a non-Linear, the LM head to the embedding, is
    copied as before). Same tensors as quantizing a separately loaded ``model``."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    kept = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
            for p in m.parameters(recurse=False)}
    memo = {id(p): p for p in model.parameters() if id(p) in linear - kept}
    return _quantize_int8(copy.deepcopy(model, memo), device, inplace=True)


def _from_loaded(model: Any, device: torch.device) -> Any:
    """The int8 model of weights ``model`` already holds unquantized on ``device``: quantized from
    them on CPU. Elsewhere int8 does not exist (``_quantize_int8`` keeps the model as it is), so it
    is ``model`` itself: reading the file again would hold the same weights twice on the GPU."""
    return _quantized_copy(model, device) if device.type == "cpu" else model


def _cache(cache_dir: str | os.PathLike[str] | None, name: str) -> Path:
    if not cache_dir:
        raise ModelLoadError(f"cannot load {name!r} without a cache directory (its GGUF weights are "
                             "assembled and dequantized there): pass cache_dir")
    return Path(cache_dir)


def load_model(name: str, *, device: str = "cpu", dtype: str = "float32",
               cache_dir: str | os.PathLike[str] | None = None,
               trust_remote_code: bool = False, loaded: Sequence[LoadedModel] = (),
               linears: str = "auto") -> LoadedModel:
    """Load a causal LM by known name, directory, ``.gguf`` file, or Hugging Face id. A known name
    or a ``.gguf`` file is dequantized once under ``cache_dir`` (the caller's settings: the CLI and
    workers pass SPECBATCH_CACHE_DIR); a directory or hub id needs none.

    ``loaded``: models this process already loaded and has not changed since (the target, when
    ``Engine.load`` loads its drafts). An int8 model whose weights one of them holds unquantized
    (same files, dtype and device) is quantized from it instead of read again, and shares its
    tokenizer: the default pair is one GGUF file, fp32 target and int8 draft. Off the CPU, where
    int8 does not exist, it is that model's own module.

    ``linears``: how its float32 CPU Linears multiply (``packed.kernel``; the caller's settings:
    the CLI and workers pass SPECBATCH_LINEARS)."""
    t0 = time.perf_counter()
    dev, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    known = KNOWN_MODELS.get(name)
    int8 = bool(known and known.int8)
    if int8 and dev.type == "cpu":
        # an int8 model computes around its int8 products in float32 whatever the target's dtype
        # (fbgemm takes float32 activations); a draft's numbers only steer proposals
        dtype, torch_dtype = "float32", torch.float32
    if problem := name_problem(name):     # the same answer submit and the HTTP API give
        raise ModelLoadError(problem)
    source = _source(name, known, cache_dir)
    base = _holding(loaded, source.path, dev, torch_dtype) if int8 else None
    if base is not None:
        tokenizer, model = base.tokenizer, _from_loaded(base.model, dev)
    else:
        tokenizer, model = _read(name, source, torch_dtype, trust_remote_code)
        model = model.to(dev)  # type: ignore[arg-type]  # (transformers' stub for .to)
        if int8:
            model = _quantize_int8(model, dev, inplace=True)   # read for this load alone
    from specbatch.engine.attention import use_folded_attention  # (transformers: imported on first load)
    from specbatch.engine.hub_kernels import unroute_hub_kernels

    use_folded_attention(model)     # a verify must not copy the KV cache per query head
    unroute_hub_kernels(model)      # compiling on another thread must not race eager decoding
    if source.gguf is not None and base is None and not int8 and linears == "auto" and can_pack(model, linears):
        gguf_blocks.give(model, source.gguf, source.path)    # its K-quant scales: products over its blocks
    pack_linears(model, linears)    # float32 on CPU: MKL packs each weight once, not every call
    seconds = time.perf_counter() - t0
    logger.info("loaded %s from %s in %.1fs%s", name, source.path, seconds,
                "" if base is None else f" (quantized from {base.name} in memory)" if model is not base.model
                else f" ({base.name}'s weights: int8 is CPU-only)")
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=dev,
                       eos_token_ids=_eos_ids(model, tokenizer),
                       max_positions=_max_positions(model.config), load_seconds=seconds,
                       info={"source": str(source.path), "int8": int8, "dtype": dtype})


def _source(name: str, known: KnownModel | None, cache_dir: str | os.PathLike[str] | None) -> _Source:
    """Where ``name``'s files are: a known name or ``.gguf`` file dequantized once under the cache."""
    path = Path(os.path.expanduser(name))
    if known is not None:
        cache = _cache(cache_dir, name)
        return _dequantize_to_cache(_known_gguf(known, cache), cache)
    if path.suffix == ".gguf" and path.is_file():
        return _dequantize_to_cache(path, _cache(cache_dir, name))
    if path.is_dir():
        return _Source(path)
    return _Source(Path(name))  # a hub id: transformers resolves it (from the local HF cache offline)


def _holding(loaded: Sequence[LoadedModel], path: Path, device: torch.device,
             dtype: torch.dtype) -> LoadedModel | None:
    """The first of ``loaded`` that holds the unquantized weights of ``path`` in ``dtype`` on ``device``."""
    for m in loaded:
        if (m.info.get("source") == str(path) and not m.info.get("int8") and m.device == device
                and DTYPES.get(m.info.get("dtype", "")) == dtype):
            return m
    return None


def _read(name: str, source: _Source, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    """(tokenizer, model in eval mode) from ``source``'s files; the model it just dequantized is not
    read back where it is what reading would give (float32: a model read in another dtype keeps
    some buffers in float32, a cast one would not)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _hf_load():   # the CLI shows its own "loading" line; a bar per model is noise
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code)
            if source.fresh is not None and dtype == torch.float32:
                return tokenizer, source.fresh
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load model {name!r}: {e}") from e
    return tokenizer, model.eval()


def load_tokenizer(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """A model's tokenizer without its weights: by known name (read from the GGUF file), ``.gguf``
    file, directory or Hugging Face id. For tools that need token ids only (grammar benchmarks)."""
    from transformers import AutoTokenizer

    known = KNOWN_MODELS.get(name)
    path = Path(os.path.expanduser(name))
    if known is not None:
        path = _known_gguf(known, _cache(cache_dir, name))
    try:
        with _hf_load():
            if path.suffix == ".gguf":
                return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            return AutoTokenizer.from_pretrained(path if path.is_dir() else name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {name!r}: {e}") from e


# transformers' from_pretrained swaps process-wide state for its duration and puts back what it found:
# PreTrainedModel.tie_weights (a no-op while loading), torch's default dtype, torch.nn.init's functions,
# the progress-bar switch. Two loads overlapping in one process (threads: concurrent first loads, a
# notebook) can put back the other's swap: tie_weights stayed a no-op for the rest of the process and
# every later tied model loaded with a random head or embedding. One load at a time, then.
_hf_lock = threading.RLock()


@contextlib.contextmanager
def _hf_load() -> Iterator[None]:
    """Around transformers' from_pretrained: one at a time in this process, with no progress bars.
    Its GGUF reader draws its own tqdm bar, which the switch does not reach (a first run's
    "Converting and de-quantizing GGUF tensors" bar under the CLI's spinner, or as one long line of
    carriage returns in a log): its module's ``tqdm`` is a disabled one meanwhile."""
    from transformers.utils import logging as hf_logging

    hf_gguf: Any = None
    with contextlib.suppress(ImportError):      # (no gguf package: nothing reads a GGUF file)
        import transformers.modeling_gguf_pytorch_utils as hf_gguf
    with _hf_lock:
        bar = getattr(hf_gguf, "tqdm", None)    # (under the lock: not another load's disabled one)
        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        if bar is not None:
            hf_gguf.tqdm = functools.partial(bar, disable=True)
        try:
            yield
        finally:
            if bar is not None:
                hf_gguf.tqdm = bar
            if was_on:
                hf_logging.enable_progress_bar()


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return frozenset(int(i) for i in ids)


def _max_positions(config: Any) -> int | None:
    text = config.get_text_config()
    for attr in POSITION_KEYS:
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from the target's (ids must mean the same)."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise ModelLoadError(not_same_tokenizer(
            draft.name, target.name, f"vocabularies differ: {plural(only_t, 'token')} only in the target, "
                                     f"{only_d} only in the draft, {moved} with different ids"))
