"""An int8 draft off the CPU: int8 is CPU-only (engine/loading.py keeps the model unquantized), so
on a GPU the default pair's draft is its target's own weights, as costly as the target. The
commands that load a pair say so in one line at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specbatch.engine.known_models import int8_off_cpu
from tests.cli.test_generate_cli import isolated_settings, run  # noqa: F401 - the fixture is used

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


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
def test_generate_on_cuda_with_the_default_pair_says_so_at_start(monkeypatch):
    # the device check passes where CUDA is (stubbed here: there is none), so the load refuses it after
    monkeypatch.setattr("specbatch.cli.common.check_device", lambda device: None)
    r = run("generate", "--prompt", "hi", "--device", "cuda", "--max-new-tokens", "2")
    assert r.exit_code != 0
    warned = [ln for ln in r.stderr.splitlines() if "CPU-only" in ln]
    assert len(warned) == 1 and "smollm2-135m-int8" in warned[0], r.stderr
    assert r.stderr.index("CPU-only") < r.stderr.index("Error")


@pytest.mark.skipif(torch.cuda.is_available(), reason="here --device cuda would load and decode")
@pytest.mark.parametrize("command", [("generate", "--prompt", "hi", "--max-new-tokens", "2"),
                                     ("run", str(EXAMPLE)),
                                     ("worker",)])
def test_a_device_this_machine_lacks_is_the_only_line(command, monkeypatch):
    # no advice for a device that is not there, no "loading", no broker wait: the error alone
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")      # nothing listens there
    monkeypatch.setenv("SPECBATCH_BROKER_WAIT_SECONDS", "0")
    r = run(*command, "--device", "cuda")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["Error: device 'cuda': CUDA is not available on this machine"], r.stderr
