"""What a loaded model computes, as one hash: its files' content plus the numerics that change results.

The results cache (specbatch.jobs.result_cache) keys results by this, so two names for the same
weights share entries and a rewritten weight file misses. Hashing a 500 MB file takes seconds, so
each file's digest is memoized on disk under ``cache_dir/fingerprints``, keyed by the file's real
path, size and mtime (nanoseconds): a second load reads one small file per model file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import uuid
from pathlib import Path
from typing import Any

import torch

from specbatch.engine import cpuinfo, int8
from specbatch.engine.loading import DTYPES

logger = logging.getLogger(__name__)

FINGERPRINT_VERSION = 1
# what a model directory holds that is not the model: never read by from_pretrained
_SKIPPED_SUFFIXES = (".md", ".txt.lock", ".lock", ".partial")


def file_digest(path: Path, memo_dir: Path | None) -> str:
    """sha256 of ``path``'s content, memoized in ``memo_dir`` by real path + size + mtime."""
    st = path.stat()
    real = os.path.realpath(path)
    memo = None
    if memo_dir is not None:
        tag = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
        memo = memo_dir / tag
        try:
            text = memo.read_text().strip()
            if len(text) == 64:
                return text
        except OSError:
            pass
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    if memo is not None:
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(hexdigest)
            os.replace(tmp, memo)  # atomic: concurrent workers write the same text
        except OSError as e:  # a read-only cache only costs the next load a re-hash
            logger.debug("cannot memoize the digest of %s: %s", path, e)
    return hexdigest


def _model_dir(source: str) -> Path | None:
    """The local directory the model was loaded from; a hub id through the local HF cache."""
    path = Path(source)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - no local snapshot: the model has no fingerprint
        logger.info("no local files for %s, so no results cache for it: %s", source, e)
        return None


def directory_digest(directory: Path, memo_dir: Path | None) -> str:
    """sha256 over the (name, content digest) of every file directly in ``directory``.

    Weights, config, generation config and tokenizer files all count: the tokenizer and the EOS
    ids change the text and where it stops. Hidden files and README-like files do not.
    """
    entries = []
    for p in sorted(directory.iterdir()):
        if p.name.startswith(".") or p.name.endswith(_SKIPPED_SUFFIXES) or not p.is_file():
            continue
        entries.append((p.name, file_digest(p, memo_dir)))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _linears(module: Any) -> dict[str, str]:
    """Packed Linears (engine/packed.py) round unlike F.linear, oneDNN's unlike MKL's, and products
    over llama.cpp's blocks (engine/blocks.py: "+blocks") unlike either: results are kept apart by kernel; nothing
    where unpacked, so other models' fingerprints stay as they were."""
    from specbatch.engine.packed import blocks_used, packed_kernel

    k = packed_kernel(module)
    return {"linears": f"{k}-packed" + ("+blocks" if blocks_used(module) else "")} if k is not None else {}


# what a result's record says where its decode began compiled and ended eager or the other way
# (a compiler failure mid-batch: ``decode_ran``): neither state's results cache key fits it
PARTLY = "partly"


def compiled_now(model: Any, graphs: Any = None) -> bool:
    """Whether decoding ``model`` goes through compiled graphs now: its compiled forward
    (``LoadedModel.compiled_live``: compile on/auto, adopted from a background compile) or ``graphs``
    (an engine's ``static_graphs``: compile=static), installed and not failed (after a compiler
    failure either decodes eagerly for good: ``Graphs.fail``). THE rule: the record, the
    fingerprint and the audit all read it."""
    return bool(getattr(model, "compiled_live", False)) or (graphs is not None and getattr(graphs, "failed", None) is None)


def decodes_compiled(engine: Any) -> bool:
    """``compiled_now`` for an engine's target (its static graphs included)."""
    return compiled_now(getattr(engine, "target", None), getattr(engine, "static_graphs", None))


def decode_ran(began: bool | None, now: bool) -> bool | str:
    """How a result's decode ran, from ``decodes_compiled`` at its start (``began``; None: not
    known, taken as ``now``) and at its end: compiled, eager, or ``PARTLY`` where a swap fell
    inside it (a background compile is adopted between batches only; a failure can come mid-batch)."""
    return now if began is None or began == now else PARTLY


def numerics(model: Any, graphs: Any = None) -> dict[str, Any]:
    """What a LoadedModel computes with beyond its files (dtype, device class, int8 scheme,
    compiled or not, packed Linears' kernel): what changes its numbers on one machine.
    ``graphs``: the engine's static graphs, if any (``compiled_now``)."""
    device = getattr(model.device, "type", str(model.device))
    dtype = str(model.info.get("dtype", "float32"))
    return {
        "dtype": str(DTYPES.get(dtype, dtype)),          # "fp32" and "float32" are one dtype
        "device": device,
        # int8 quantization happens on the CPU only (loading._quantize_int8); "rows8"/"rows7":
        # per-row activation scales of 8 or 7 bits (engine/int8.py), whose numbers differ from
        # torch.ao's per-tensor ones and from each other
        "int8": int8.numerics() if bool(model.info.get("int8")) and device == "cpu" else False,
        # a compiled forward may round differently from eager: kept apart, to be safe
        "compiled": compiled_now(model, graphs),
        **_linears(model.model),
    }


@functools.cache
def processor(device_type: str, index: int | None = None) -> str:
    """The processor a device type computes on: the CPU's model name and core count, or the GPU's name."""
    if device_type == "cuda":
        return torch.cuda.get_device_name(index) if torch.cuda.is_available() else "cuda"
    return f"{cpuinfo.field('model name') or platform.processor()} x{os.cpu_count()}"


def decoded_with(model: Any, graphs: Any = None, compiled: bool | str | None = None) -> dict[str, Any]:
    """``numerics`` plus what a results cache on one machine need not key but a result on
    another machine may round by: the processor (its kernels: docs/DESIGN.md, "Attention folds
    the query heads") and the torch and transformers versions. Recorded with every result
    (``results.numerics``), so that ``specbatch audit`` re-decodes it the same way and, where
    it cannot, says what differs (docs/CONTRACTS.md). ``compiled``: how the result's decode ran
    where the caller knows (``decode_ran``: ``PARTLY`` too); else ``compiled_now``, read at each
    call (a failure turns it off with the same forward installed). The rest is made once per
    compiled forward (``LoadedModel.decoded``: it walks the modules)."""
    if model.decoded is None or model.decoded[0] is not model.compiled:
        import transformers

        device = getattr(model.device, "type", str(model.device))
        name = processor(device, getattr(model.device, "index", None))
        if device == "cpu" and cpuinfo.vector_isa():
            name = f"{name} ({cpuinfo.vector_isa()})"
        plain = numerics(model)
        model.decoded = (model.compiled, {**plain, "dtype": plain["dtype"].removeprefix("torch."),  # as --dtype
                                          "processor": name, "torch": torch.__version__,
                                          "transformers": transformers.__version__})
    record = dict(model.decoded[1])
    record["compiled"] = compiled_now(model, graphs) if compiled is None else compiled
    return record


def decoded_by(engine: Any, compiled: bool | str | None = None) -> dict[str, Any]:
    """``decoded_with`` for an engine's target, its static graphs included: what a result of it
    records (worker.guard.engine_models) and what the audit compares that with (jobs/audit.py)."""
    return decoded_with(engine.target, getattr(engine, "static_graphs", None), compiled)


def fingerprint_parts(model: Any, cache_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """What ``model_fingerprint`` hashes: the model's files' digest (seconds for a cold memo: a
    caller keeps it, result_cache.target_identity per engine) and ``numerics`` made once; None
    when the files cannot be found (a hub id with no local snapshot). ``fingerprint_of`` sets
    the compiled state, which changes while the model serves."""
    directory = _model_dir(str(model.info.get("source", model.name)))
    if directory is None:
        return None
    memo = Path(cache_dir) / "fingerprints" if cache_dir else None
    return {"v": FINGERPRINT_VERSION, "files": directory_digest(directory, memo), **numerics(model)}


def fingerprint_of(parts: dict[str, Any], compiled: bool) -> str:
    """sha256 of ``fingerprint_parts`` with the compiled state ``compiled``. An eager model's is
    what it always was (``compiled: False`` was hashed before the state was read per call)."""
    return hashlib.sha256(json.dumps({**parts, "compiled": bool(compiled)}, sort_keys=True).encode()).hexdigest()


def model_fingerprint(model: Any, cache_dir: str | os.PathLike[str] | None, graphs: Any = None) -> str | None:
    """sha256 of a LoadedModel's files and numerics (``numerics``) as it decodes now (``graphs``:
    the engine's static graphs, if any); None when the files cannot be found (a hub id with no
    local snapshot)."""
    parts = fingerprint_parts(model, cache_dir)
    return None if parts is None else fingerprint_of(parts, compiled_now(model, graphs))
