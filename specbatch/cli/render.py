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


# fewer drafted steps than the autopilot judges a trial on (autopilot.py, trial_steps): their
# tokens per step are a sample, not a measurement
FEW_DRAFTED_STEPS = 5


def speculation_line(d: dict[str, Any]) -> str | None:
    """Why a job with a draft drafted on few or no steps (the job's ``stats.speculation``); None
    where it has no draft, no decoded step, or drafted on most steps. Without it a job that never
    drafted reads as a broken draft. The decision was made on measured tokens per second; the
    numbers shown are per drafted step and understate its cost (the draft's seconds only: not the
    wider verify, nor the draft catching up on rows decoded plainly), so they are labelled as such
    and never offered as the reason."""
    sp = (d.get("stats") or {}).get("speculation") or {}
    steps, drafted = sp.get("steps") or 0, sp.get("drafted_steps") or 0
    if not d.get("drafts") or not steps or drafted >= steps / 2:
        return None
    either = "the text is the target's either way"
    if "ngram" in d["drafts"]:      # it proposes nothing where the text repeats nothing of its context
        either = f"the n-gram drafter drafts only where the text repeats its context; {either}"
    if not drafted:
        return (f"off: none of {steps} steps drafted; the autopilot decoded plainly and never tried drafting "
                "(a drafting trial first catches the draft up on every row, about a prefill of the batch, "
                f"and waits until that fits 10% of the time spent: README 'Throughput'); {either}")
    off = sp.get("switched_off_requests") or 0
    why = (f"the draft-length controller measured drafting slower than plain steps and turned it off for "
           f"{plural(off, 'request')}" if off else
           "the autopilot measured more tokens/s from plain steps than from drafting (its trials also "
           "pay the draft catching up on every row)")
    tokens, cost = sp.get("tokens_per_drafted_step"), sp.get("drafted_step_cost")
    seen = f"{plural(drafted, 'drafted step')} {'is' if drafted == 1 else 'are'} too few to judge by" \
        if drafted < FEW_DRAFTED_STEPS else "per drafted step"
    seen += f": {num(tokens, '{:.2f}')} tokens emitted"
    if (acc := ((d.get("stats") or {}).get("acceptance_rate") or {}).get("token_weighted")) is not None:
        seen += f" (acceptance {acc:.0%})"
    if cost is not None:
        seen += f", at least {cost:.1f}x a plain step's time (the draft's time only, not the wider verify)"
    return f"mostly plain: drafted on {drafted} of {steps} steps ({drafted / steps:.0%}); {why}; {seen}; {either}"
