"""An int8 draft off the CPU: int8 is CPU-only (engine/loading.py keeps the model unquantized), so
on a GPU the default pair's draft is its target's own weights, as costly as the target. The
commands that load a pair say so in one line at start."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine.known_models import int8_off_cpu
from tests.cli.test_generate_cli import isolated_settings, run  # noqa: F401 - the fixture is used


def test_the_default_pair_off_the_cpu_is_a_draft_as_costly_as_its_target():
    line = int8_off_cpu("smollm2-135m", ["smollm2-135m-int8"], "cuda:0")
    assert line is not None and "smollm2-135m-int8" in line and "as costly as the target" in line
    # another int8 draft only runs unquantized; CPU, or no int8 draft: nothing to say
    other = int8_off_cpu("qwen2.5-coder-1.5b", ["qwen2.5-coder-0.5b-int8"], "cuda")
    assert other is not None and "unquantized" in other and "costly" not in other
    assert int8_off_cpu("smollm2-135m", ["smollm2-135m-int8"], "cpu") is None
    assert int8_off_cpu("qwen2.5-coder-1.5b", ["qwen2.5-coder-0.5b"], "cuda") is None
    assert int8_off_cpu("/some/dir", ["/other/dir"], "cuda") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="here --device cuda would load and decode")
def test_generate_on_cuda_with_the_default_pair_says_so_at_start():
    r = run("generate", "--prompt", "hi", "--device", "cuda", "--max-new-tokens", "2")
    assert r.exit_code != 0       # (no CUDA here: the load refuses the device after the warning)
    warned = [ln for ln in r.stderr.splitlines() if "CPU-only" in ln]
    assert len(warned) == 1 and "smollm2-135m-int8" in warned[0], r.stderr
    assert r.stderr.index("CPU-only") < r.stderr.index("Error")
