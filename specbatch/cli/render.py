"""How job summaries read on a terminal: one-line renderers shared by `status`, `jobs` and `run`."""

from __future__ import annotations

from typing import Any


def when(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def models(d: dict[str, Any]) -> str:
    """A job's target <- its pool (``drafters``), or a --model-map route's (``drafts``)."""
    drafts = d.get("drafters", d["drafts"])
    return d["target"] + (f" <- {', '.join(drafts)}" if drafts else "")


def failure_lines(d: dict[str, Any]) -> list[str]:
    """The summary's first failed requests, one line each, and how to see them all."""
    shown = d.get("failures") or []
    lines = [f"line {f['line_no']} ({f['custom_id']}): {f['error']}" for f in shown]
    more = d["request_counts"].get("failed", 0) - len(shown)
    if shown:
        lines.append((f"and {more} more; " if more > 0 else "")
                     + f"`specbatch export {d['id']} --status failed` lists every failure")
    return lines


def counts_line(c: dict[str, int]) -> str:
    return "  ".join(f"{k} {c[k]}" for k in ("total", "pending", "running", "completed", "failed",
                                             "cancelled"))


def batching_line(b: dict[str, Any]) -> str:
    """ "B=16 81% of decode time, B=8 12%, ...; speculated 20% of steps" (largest share first)."""
    shares = sorted(b["batch_size_share"].items(), key=lambda kv: -kv[1])
    sizes = ", ".join(f"B={k} {v:.0%}" for k, v in shares[:5])
    spec = b.get("speculative_step_share")
    return sizes + ("" if spec is None else f"; speculated {spec:.0%} of steps")
