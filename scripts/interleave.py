"""What the A-against-B scripts share (pair_linears, trees_job, run_variants): the order of their
runs, A B B A, so a machine that slows or speeds up over a run weighs on both alike, and the one
result line a child process prints."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def abba(round_: int, names: Sequence[str]) -> list[str]:
    """The order to run ``names`` in round ``round_``: an even round as given, an odd one reversed."""
    return list(names if round_ % 2 == 0 else names[::-1])


def child_result(cmd: list[str], env: dict[str, str], who: str, cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd`` and return the JSON of its ``RESULT `` line; exit naming ``who`` without one."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{who}: no result (exit {out.returncode})\n{out.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))
