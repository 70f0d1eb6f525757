"""The bench's markdown report: what it says about compiling."""

from __future__ import annotations

from specbatch.bench.report import markdown


def _result(models: list[dict]) -> dict:
    return {"options": {"max_new_tokens": 8, "repeats": 1, "dtype": "float32"}, "target": "t",
            "drafters": [], "prompts": ["p"], "best_hf_assisted": "none", "configs": [],
            "failures": [], "warnings": [],
            "environment": {"device": "cpu", "threads": 1, "torch": "2.13.0"},
            "costs": {"prefix_tokens": 4, "target_step_ms": {}, "verify_ratio": {}, "draft_step_ms": {},
                      "c": {}},
            "compile": {"this_start_cached": False, "seconds": 30.0, "reason": "compile on",
                        "models": models}}


def test_the_compile_table_says_which_frozen_variant_was_kept_and_why():
    model = {"model": "t", "seconds": 30.0, "first_start_seconds": 30.0, "cached": False,
             "graphs": {"1x1:1": 10.0, "1x4:2": 12.0}, "speedups": {"1x1:1": 1.3, "1x4:2": 1.2},
             "frozen": False, "frozen_gain": {"1x1:1": 1.01, "1x4:2": 0.99}}
    text = markdown(_result([model]))
    assert "| t | 30 | 30 | False | 1x1:1 10s (1.30x), 1x4:2 12s (1.20x) |" in text
    assert "- t: not-frozen / frozen step time 1x1:1 1.01x, 1x4:2 0.99x; kept not frozen" in text
    # a start that compiled one variant only (recorded, or memory) has no comparison to show
    assert "not-frozen / frozen" not in markdown(_result([{**model, "frozen_gain": {}}]))
