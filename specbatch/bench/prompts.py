"""Prompt sets: the bundled ones (package data under prompts/) or a JSONL file of the user's.

A line is ``{"id": ..., "category": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``;
``id`` and ``category`` are optional in a user's file. A bare ``prompt`` is sent as one user
message through the target's chat template when it has one (the bundled models are instruct
models), else as plain text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specbatch.errors import InputError

BUNDLED = ("code", "chat", "grounded")


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


def _parse_lines(lines: list[str], source: str, default_category: str) -> list[BenchPrompt]:
    out: list[BenchPrompt] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"not valid JSON ({e.msg})", path=source, line_no=no) from None
        if not isinstance(obj, dict):
            raise InputError("each line must be a JSON object", path=source, line_no=no)
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if (prompt is None) == (messages is None):
            raise InputError('give exactly one of "prompt" or "messages"', path=source, line_no=no)
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise InputError("must be a non-empty string", path=source, line_no=no, field="prompt")
        if messages is not None and (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "content" in m for m in messages)):
            raise InputError("must be a non-empty list of {role, content} objects", path=source,
                             line_no=no, field="messages")
        out.append(BenchPrompt(id=str(obj.get("id", f"{default_category}-{no}")),
                               category=str(obj.get("category", default_category)), prompt=prompt,
                               messages=tuple(messages) if messages is not None else None))
    if not out:
        raise InputError("no prompts", path=source)
    return out


def bundled(name: str) -> list[BenchPrompt]:
    """One bundled set: ``code``, ``chat`` or ``grounded`` (input-grounded tasks)."""
    text = resources.files("specbatch.bench").joinpath("prompts", f"{name}.jsonl").read_text("utf-8")
    return _parse_lines(text.splitlines(), f"{name}.jsonl", name)


def load_prompts(spec: str) -> list[BenchPrompt]:
    """``all``, a comma list of bundled set names, or a JSONL file path."""
    path = Path(spec).expanduser()
    if path.is_file():
        return _parse_lines(path.read_text("utf-8").splitlines(), str(path), path.stem)
    names = list(BUNDLED) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in BUNDLED]
    if unknown or not names:
        raise InputError(f"--prompts {spec!r}: not a file and not a bundled set; use a JSONL file, "
                         f"'all', or a comma list of {', '.join(BUNDLED)}")
    return [p for n in names for p in bundled(n)]


def select(prompts: list[BenchPrompt], n: int | None) -> list[BenchPrompt]:
    """The first ``n`` prompts taken round-robin across categories (all when n is None)."""
    if n is None or n >= len(prompts):
        return list(prompts)
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = list(by_cat.values())
    out: list[BenchPrompt] = []
    i = 0
    while len(out) < n:
        q = queues[i % len(queues)]
        k = i // len(queues)
        if k < len(q):
            out.append(q[k])
        i += 1
    return out
