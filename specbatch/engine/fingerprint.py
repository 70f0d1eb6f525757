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
    """Packed Linears (engine/packed.py) round unlike F.linear, and oneDNN's unlike MKL's: results
    are kept apart by kernel; nothing where unpacked, so other models' fingerprints stay as they were."""
    from specbatch.engine.packed import packed_kernel

    k = packed_kernel(module)
    return {"linears": f"{k}-packed"} if k is not None else {}


def numerics(model: Any) -> dict[str, Any]:
    """What a LoadedModel computes with beyond its files (dtype, device class, int8 scheme,
    compiled or not, packed Linears' kernel): what changes its numbers on one machine."""
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
        "compiled": getattr(model, "compiled", None) is not None,
        **_linears(model.model),
    }


@functools.cache
def processor(device_type: str, index: int | None = None) -> str:
    """The processor a device type computes on: the CPU's model name and core count, or the GPU's name."""
    if device_type == "cuda":
        return torch.cuda.get_device_name(index) if torch.cuda.is_available() else "cuda"
    return f"{cpuinfo.field('model name') or platform.processor()} x{os.cpu_count()}"


def decoded_with(model: Any) -> dict[str, Any]:
    """``numerics`` plus what a results cache on one machine need not key but a result on
    another machine may round by: the processor (its kernels: docs/DESIGN.md, "Attention folds
    the query heads") and the torch and transformers versions. Recorded with every result
    (``results.numerics``), so that ``specbatch audit`` re-decodes it the same way and, where
    it cannot, says what differs (docs/CONTRACTS.md). Made once per compiled forward: only
    installing or adopting one changes it after the load (``LoadedModel.decoded``)."""
    if model.decoded is not None and model.decoded[0] is model.compiled:
        return dict(model.decoded[1])
    import transformers

    device = getattr(model.device, "type", str(model.device))
    name = processor(device, getattr(model.device, "index", None))
    if device == "cpu" and cpuinfo.vector_isa():
        name = f"{name} ({cpuinfo.vector_isa()})"
    plain = numerics(model)
    record = {**plain, "dtype": plain["dtype"].removeprefix("torch."),    # what --dtype takes
              "processor": name, "torch": torch.__version__, "transformers": transformers.__version__}
    model.decoded = (model.compiled, record)
    return dict(record)


def model_fingerprint(model: Any, cache_dir: str | os.PathLike[str] | None) -> str | None:
    """sha256 of a LoadedModel's files and numerics (``numerics``); None when the files
    cannot be found (a hub id with no local snapshot)."""
    directory = _model_dir(str(model.info.get("source", model.name)))
    if directory is None:
        return None
    memo = Path(cache_dir) / "fingerprints" if cache_dir else None
    blob = {"v": FINGERPRINT_VERSION, "files": directory_digest(directory, memo), **numerics(model)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
