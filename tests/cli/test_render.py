"""The summary lines `status` and `run` share (specbatch/cli/render.py), built from a job's summary."""

from __future__ import annotations

from typing import Any

from specbatch.cli.render import speculation_line


def _job(drafted: int, steps: int = 91, tokens: float | None = 4.0, cost: float | None = 1.1, off: int = 0,
         acceptance: float | None = 1.0, drafts: tuple[str, ...] = ("smollm2-135m-int8",)) -> dict[str, Any]:
    return {"drafts": list(drafts), "stats": {
        "acceptance_rate": {"token_weighted": acceptance, "request_mean": acceptance},
        "speculation": {"steps": steps, "drafted_steps": drafted, "tokens_per_drafted_step": tokens,
                        "drafted_step_cost": cost, "switched_off_requests": off}}}


def test_one_drafted_step_is_a_sample_not_the_reason() -> None:
    """A new-user walk read "measured and switched off: drafted on 1 of 91 steps; a drafted step
    emitted 4.00 tokens (acceptance 100%) at about 1.1x a plain step's cost" as a win switched off."""
    line = speculation_line(_job(drafted=1))
    assert line == ("mostly plain: drafted on 1 of 91 steps (1%); the autopilot measured more tokens/s from "
                    "plain steps than from drafting (its trials also pay the draft catching up on every row); "
                    "1 drafted step is too few to judge by: 4.00 tokens emitted (acceptance 100%), at least "
                    "1.1x a plain step's time (the draft's time only, not the wider verify); the text is the "
                    "target's either way")


def test_the_controller_switching_off_is_the_reason_given() -> None:
    line = speculation_line(_job(drafted=57, steps=615, tokens=1.0, cost=3.8, off=2, acceptance=0.0))
    assert line is not None
    assert line.startswith("mostly plain: drafted on 57 of 615 steps (9%); the draft-length controller measured "
                           "drafting slower than plain steps and turned it off for 2 requests; per drafted step: "
                           "1.00 tokens emitted (acceptance 0%), at least 3.8x a plain step's time"), line
    assert "autopilot" not in line and "too few" not in line


def test_none_drafted_says_the_autopilot_never_tried() -> None:
    line = speculation_line(_job(drafted=0, steps=923, tokens=None, cost=None, acceptance=None))
    assert line is not None and line.startswith("off: none of 923 steps drafted; the autopilot decoded plainly "
                                                "and never tried drafting"), line
    assert "n-gram" not in line


def test_an_ngram_pool_says_it_drafts_only_on_repeats() -> None:
    line = speculation_line(_job(drafted=0, drafts=("ngram",)))
    assert line is not None and "the n-gram drafter drafts only where the text repeats its context" in line


def test_no_line_where_it_drafted_on_most_steps_or_has_no_draft() -> None:
    assert speculation_line(_job(drafted=50, steps=91)) is None
    assert speculation_line(_job(drafted=0, drafts=())) is None
