"""How job summaries read on a terminal: one-line renderers shared by `status`, `jobs` and `run`."""

from __future__ import annotations

from typing import Any

from specbatch.plural import plural


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


def speculation_line(d: dict[str, Any]) -> str | None:
    """Why a job with a draft drafted on few or no steps, in numbers (the job's ``stats.speculation``);
    None where it has no draft, no decoded step, or drafted on most steps. Without it a job that
    never drafted reads as a broken draft."""
    sp = (d.get("stats") or {}).get("speculation") or {}
    steps, drafted = sp.get("steps") or 0, sp.get("drafted_steps") or 0
    if not d.get("drafts") or not steps or drafted >= steps / 2:
        return None
    either = "the text is the target's either way"
    if not drafted:
        return (f"off: none of {steps} steps drafted; plain batched steps were measured and a drafting "
                "trial never fitted the autopilot's budget (it waits until the draft's catch-up, about a "
                f"prefill of the batch, fits 10% of the time spent: README 'Throughput'); {either}")
    tokens, cost = sp.get("tokens_per_drafted_step"), sp.get("drafted_step_cost")
    why = f"a drafted step emitted {num(tokens, '{:.2f}')} tokens"
    if (acc := ((d.get("stats") or {}).get("acceptance_rate") or {}).get("token_weighted")) is not None:
        why += f" (acceptance {acc:.0%})"
    if cost is not None:
        why += f" at about {cost:.1f}x a plain step's cost"
    off = sp.get("switched_off_requests") or 0
    who = f"; the draft-length controller turned it off for {plural(off, 'request')}" if off else ""
    return f"measured and switched off: drafted on {drafted} of {steps} steps ({drafted / steps:.0%}); {why}{who}; {either}"
