"""What a model name points at on this machine, read without loading weights or importing torch:
where its tokenizer and config live, and its context length. Intake uses it to refuse a prompt
that cannot fit before a job exists; ``loading`` uses the same cache layout.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbatch.engine.known_models import HF_ID, KNOWN_MODELS
from specbatch.plural import plural

logger = logging.getLogger(__name__)

# config keys that hold a model's context length, in the order transformers' configs use them
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


@dataclass(frozen=True)
class ModelFiles:
    """A model's tokenizer and config as files here: a ``save_pretrained`` directory, or a GGUF
    file (``gguf_file`` inside ``directory``) not yet dequantized."""

    directory: Path
    gguf_file: str | None = None


def gguf_cache_key(path: Path) -> str:
    """The name of a GGUF file's dequantized copy under ``CACHE_DIR/dequantized``."""
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()
    return f"{path.stem}-{h[:12]}"


def _from_gguf(gguf: Path, cache_dir: Path) -> ModelFiles:
    dequantized = cache_dir / "dequantized" / gguf_cache_key(gguf)
    if (dequantized / "config.json").is_file():
        return ModelFiles(dequantized)
    return ModelFiles(gguf.parent, gguf.name)


def gguf_path(name: str, cache_dir: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``name`` loads from, where it is one and on this machine: a known model's
    (inside its package, or assembled under the cache from its slices by a first load), or a
    ``.gguf`` path. None for a directory or a hub id. Other runtimes (llama.cpp) read the same
    file; nothing is assembled or converted here."""
    known = KNOWN_MODELS.get(name)
    if known is not None:
        if len(known.packages) > 1:           # slices are assembled into the cache on first load
            gguf = Path(cache_dir) / "gguf" / known.filename
        else:
            spec = importlib.util.find_spec(known.packages[0])
            if spec is None or not spec.submodule_search_locations:
                return None
            gguf = Path(next(iter(spec.submodule_search_locations))) / known.filename
        return gguf if gguf.is_file() else None
    path = Path(os.path.expanduser(name))
    try:
        return path if path.suffix == ".gguf" and path.is_file() else None
    except OSError:
        return None


def local_files(name: str, cache_dir: str | os.PathLike[str]) -> ModelFiles | None:
    """Where ``name``'s tokenizer and config are on this machine; None when they are not here (a
    known model whose weights are not installed, a Hugging Face id not in the local cache, a path
    only the workers hold). Never downloads, assembles or converts anything."""
    cache = Path(cache_dir)
    if name in KNOWN_MODELS:
        gguf = gguf_path(name, cache)
        return _from_gguf(gguf, cache) if gguf is not None else None
    path = Path(os.path.expanduser(name))
    try:
        if path.suffix == ".gguf" and path.is_file():
            return _from_gguf(path, cache)
        if (path / "config.json").is_file():
            return ModelFiles(path)
    except OSError:
        return None
    if HF_ID.fullmatch(name):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
        if isinstance(found, str):
            return ModelFiles(Path(found).parent)
    return None


def context_length(files: ModelFiles) -> int | None:
    """The model's context in tokens (as ``loading`` reads it from the loaded config), or None."""
    if files.gguf_file is not None:
        value = _gguf_header(files.directory / files.gguf_file).get("context_length")
        return int(value) if isinstance(value, int) and value > 0 else None
    try:
        config = json.loads((files.directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return max_positions(config)


def vocab_size(files: ModelFiles) -> int | None:
    """The size of the model's logits (its vocabulary, padding included), or None. A GGUF file's
    vocabulary is its token list unless its architecture states a size."""
    if files.gguf_file is not None:
        header = _gguf_header(files.directory / files.gguf_file)
        value = header.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
        return header.get("tokens") or None
    try:
        config = json.loads((files.directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config.get("text_config"), config) if isinstance(config, dict) else ():
        value = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def max_positions(config: dict[str, Any]) -> int | None:
    """The context length in a config's dict (its text config first, as multimodal configs nest it)."""
    for part in (config.get("text_config"), config):
        if not isinstance(part, dict):
            continue
        for key in POSITION_KEYS:
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _gguf_header(path: Path) -> dict[str, Any]:
    """The few header values intake reads (context length, vocabulary size, token count), read
    once per file version in this process: parsing a GGUF header takes seconds of CPU, and the
    API server reads it for every batch it creates."""
    st = path.stat()
    return _read_gguf_header(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_gguf_header(path: Path, size: int, mtime_ns: int) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _gguf_value(reader, "general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {"context_length": _gguf_value(reader, f"{arch}.context_length") if arch else None,
            "vocab_size": _gguf_value(reader, f"{arch}.vocab_size") if arch else None,
            "tokens": len(tokens.data) if tokens is not None and tokens.data else None}


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8", errors="replace")
    return part[0].item() if len(part) else None


def load_tokenizer(files: ModelFiles) -> Any:
    """The model's transformers tokenizer (this imports transformers, and with it torch)."""
    from transformers import AutoTokenizer

    if files.gguf_file is not None:
        return AutoTokenizer.from_pretrained(files.directory, gguf_file=files.gguf_file)
    return AutoTokenizer.from_pretrained(files.directory)


def context_problem(n_prompt: int, max_new_tokens: int, model: str, context: int | None,
                    budget: str = "max_new_tokens") -> str | None:
    """Why a prompt of ``n_prompt`` tokens cannot decode ``max_new_tokens`` within ``model``'s
    context, or None; the engine and intake give the same message (``budget``: the name the user
    gave the number, intake's ``max_tokens``, ``metadata.specbatch_max_tokens``, ...)."""
    if context is None or n_prompt + max_new_tokens <= context:
        return None
    return (f"prompt ({plural(n_prompt, 'token')}) + {budget} ({max_new_tokens}) exceeds the context "
            f"of {model!r} ({context} tokens); shorten the prompt or lower {budget}")
