"""`specbatch run --processes N`: the job decoded by processes forked after one load
(specbatch/worker/forked.py). Real processes, a real SQLite file, the tiny models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.worker.forked import MIN_ROWS, forkable, split
from tests.robust.test_run import _counts, _wait_results, resume_interrupted

EXE = str(Path(sys.executable).parent / "specbatch")
REPO = Path(__file__).resolve().parents[2]


def _prompts(path: Path, n: int) -> Path:
    """n greedy prompts of staggered lengths, and two seeded sampled ones with n=2."""
    lines = [{"custom_id": f"q{i}", "prompt": f"word {i} and", "max_tokens": 6 + 3 * (i % 7)} for i in range(n)]
    lines += [{"custom_id": f"s{i}", "prompt": f"sample {i}", "max_tokens": 12, "temperature": 0.9, "seed": 7 + i,
               "n": 2} for i in range(2)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _results(url: str) -> tuple[dict[tuple[str, int], list[int]], set[str]]:
    """(custom id, sample) -> tokens, and the workers that wrote them, of the newest job."""
    from sqlalchemy import select

    from specbatch.db import session_factory
    from specbatch.db.models import Job, Request, Result

    with session_factory(url).begin() as s:
        job = s.scalars(select(Job.id).order_by(Job.created_at.desc())).first()
        rows = s.execute(select(Request.custom_id, Result.sample_index, Result.token_ids, Result.worker)
                         .join(Request, Request.id == Result.request_id).where(Result.job_id == job)).all()
    return {(c, i): list(t) for c, i, t, _ in rows}, {w for *_, w in rows}


def _run(url: str, *args: str) -> None:
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["run", *args], env={"SPECBATCH_DATABASE_URL": url,
                                                         "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert result.exit_code == 0, (result.output, result.exception)


def test_split_cuts_contiguous_runs_of_about_equal_tokens() -> None:
    ids = list(range(40))
    parts = split(ids, [10] * 20 + [30] * 20, 2)
    assert [i for p in parts for i in p] == ids                 # contiguous, in order, all of them
    # 800 tokens: the first run ends where it first holds half (27 ids: 410 tokens, 26 held 380)
    assert [len(p) for p in parts] == [27, 13]
    assert split(ids, [1] * 40, 8) == [ids[k:k + MIN_ROWS] for k in range(0, 40, MIN_ROWS)]   # no run < MIN_ROWS
    assert split(ids[:MIN_ROWS + 3], [1] * (MIN_ROWS + 3), 4) == [ids[:MIN_ROWS + 3]]
    assert split([], [], 2) == [[]]


def test_forkable_says_why_not() -> None:
    plan = SimpleNamespace(enabled=False)
    ok = SimpleNamespace(target=SimpleNamespace(device="cpu"), compile_plan=plan, background=None,
                         static_cache=False, lanes=1)
    assert forkable(ok, "sqlite:////tmp/x.db") is None
    assert forkable(ok, "postgresql://h/db") is None
    assert "in-memory" in forkable(ok, "sqlite://")
    for change, words in [({"target": SimpleNamespace(device="cuda:0")}, "CUDA"),
                          ({"compile_plan": SimpleNamespace(enabled=True)}, "compiled"),
                          ({"static_cache": True}, "static"), ({"lanes": 2}, "lanes")]:
        assert words in forkable(SimpleNamespace(**{**vars(ok), **change}), "sqlite:////tmp/x.db")


def test_two_processes_write_what_one_process_does(tmp_path: Path, tiny_models: Path) -> None:
    """Greedy rows token for token, seeded samples too, each process decoding its part."""
    prompts = _prompts(tmp_path / "p.jsonl", 30)
    models = ["--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"), "--no-cache"]
    one, two = f"sqlite:///{tmp_path / 'one.db'}", f"sqlite:///{tmp_path / 'two.db'}"
    _run(one, str(prompts), *models)
    _run(two, str(prompts), *models, "--processes", "2")
    (tokens1, workers1), (tokens2, workers2) = _results(one), _results(two)
    assert len(tokens1) == 34 and tokens2 == tokens1
    # forked processes wrote them, not this one (usually both; one that runs dry claims what the
    # other has not claimed yet, so either may end up with all of it)
    pids = {int(w.rsplit(":", 1)[1]) for w in workers2}
    assert workers1 == {f"embedded@{socket.gethostname()}:{os.getpid()}"} and os.getpid() not in pids


def _always_contended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine's thread governor a scripted one whose machine is always contended (in the forked
    children too: they fork after the patch)."""
    from specbatch.engine import Engine
    from specbatch.engine.contention import Contention

    def contended(self: Engine, lanes: int) -> Contention:
        if self.contention is None:
            self.contention = Contention(2, set_threads=lambda n: None)
            real = self.contention.observe
            self.contention.observe = lambda wall, cpu: real(1.0, 0.5 * self.contention.now)  # type: ignore[method-assign]
        return self.contention

    monkeypatch.setattr(Engine, "_contention", contended)


def test_the_run_end_line_counts_the_forked_processes_governors(tmp_path: Path, tiny_models: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each forked process governs its own threads (engine/contention.py); the parent, which
    decodes nothing, printed no end line however long they decoded on fewer threads. A scripted
    governor whose machine is always contended, in each child (forked after the patch)."""
    _always_contended(monkeypatch)
    prompts = _prompts(tmp_path / "p.jsonl", 30)
    url = f"sqlite:///{tmp_path / 'two.db'}"
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"), "--draft", "none",
                                      "--no-cache", "--processes", "2"],
                                env={"SPECBATCH_DATABASE_URL": url, "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert result.exit_code == 0, (result.output, result.exception)
    line = next((x for x in " ".join(result.stderr.split()).split("specbatch: ") if x.startswith("other processes")), "")
    assert line.startswith("other processes held this machine's cores: decoded on 1 of 2 torch threads for "), \
        result.stderr
    # both children decode (usually: one that runs dry claims the other's rows): both are counted
    assert "of its 2 decode processes" in line or "decode processes" not in line, line


def test_routes_on_one_engine_count_its_decode_processes_once(tmp_path: Path, tiny_models: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routes of one pair (a --model-map name mapped to the job's own pair) decode with the
    same engine, forking 2 processes for each: the end line said "in 3 of its 4 decode processes"
    of a `--processes 2` run. A slot's tallies add up over the routes."""
    import re

    _always_contended(monkeypatch)
    target = str(tiny_models / "llama")
    prompts = _prompts(tmp_path / "p.jsonl", 20)
    with prompts.open("a") as f:     # as many lines again, routed by body.model to the same pair
        for i in range(20):
            f.write(json.dumps({"custom_id": f"m{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": f"mapped {i} and", "max_tokens": 6 + 3 * (i % 7)}})
                    + "\n")
    url = f"sqlite:///{tmp_path / 'routes.db'}"
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", target, "--draft", "none", "--no-cache",
                                      "--model-map", f"m={target}", "--processes", "2"],
                                env={"SPECBATCH_DATABASE_URL": url, "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"})
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [x for x in " ".join(result.stderr.split()).split("specbatch: ") if x.startswith("other processes")]
    assert len(lines) == 1, result.stderr          # one engine: one line
    counts = re.findall(r"in (\d+) of its (\d+) decode processes", lines[0])
    assert all(int(n) <= int(of) <= 2 for n, of in counts), lines[0]


def test_a_failing_process_is_one_line_the_others_stop_and_resume_finishes(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specbatch.engine.decoder import Decoder

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    real, steps, parent, first = Decoder._step, [0], os.getpid(), tmp_path / "first-failure"

    def failing(self):   # noqa: ANN001, ANN202
        steps[0] += 1
        if steps[0] == 12 and os.getpid() != parent:
            try:    # the first child there fails; the other goes on until it is stopped
                os.close(os.open(first, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return real(self)
            raise RuntimeError("device lost")
        return real(self)

    monkeypatch.setattr(Decoder, "_step", failing)
    prompts = _prompts(tmp_path / "p.jsonl", 30)
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                      "--processes", "2", "--no-cache"])
    assert result.exit_code == 1, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error: ")]
    assert "decoding failed in one of its 2 processes (RuntimeError: device lost)" in line, line
    assert "run --resume" in line and "Traceback" not in result.stderr
    get_settings.cache_clear()
    job = json.loads(CliRunner().invoke(cli, ["jobs", "--json"]).output)[0]
    assert job["status"] == "interrupted", job
    results, by = _counts(url)
    assert 0 < results < 32 and by.get("running", 0) == 0    # the other process handed its rows back
    monkeypatch.setattr(Decoder, "_step", real)
    resumed = CliRunner().invoke(cli, ["run", "--resume", job["id"], "--json"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["request_counts"]["completed"] == 32


def test_a_second_ctrl_c_hands_back_what_the_ended_processes_held_and_marks_the_job_interrupted(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C ends the decode processes at once (SIGTERM): in one process the run hands its
    claims back and marks the job interrupted (README), but over --processes N the children's
    claims stayed running on their dead names and the job was not interrupted, so status and the
    next `run FILE` read it as killed (review52). The parent hands them back as it ends them."""
    from specbatch.worker import forked

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    real = forked._gather

    def second_ctrl_c(children, stop, on_progress):   # noqa: ANN001, ANN202
        def progress(event):   # noqa: ANN001, ANN202
            raise KeyboardInterrupt   # what stop_on_signals' handler raises on the second signal
        return real(children, stop, progress)

    monkeypatch.setattr(forked, "_gather", second_ctrl_c)
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path / "p.jsonl", 30)), "--target",
                                      str(tiny_models / "llama"), "--processes", "2", "--no-cache"])
    assert result.exit_code == 130, result.output
    assert "stopped at once" in result.stderr and "Traceback" not in result.stderr
    by = _counts(url)[1]
    assert 0 < by.get("completed", 0) < 32 and by["completed"] + by.get("pending", 0) == 32, by   # none held
    monkeypatch.setattr(forked, "_gather", real)
    resume_interrupted(url, 32)


@pytest.mark.slow     # .ci/run runs it, with the other Ctrl-C runs (tests/robust/test_run.py)
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_stops_every_process_and_resume_finishes(tmp_path: Path, tiny_models: Path, signals: int) -> None:
    """One Ctrl-C: each process stops at its next step and gives its rows back (exit 130). Two:
    they end at once and the parent gives back what they held; resume finishes the job."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    env = {**os.environ, "SPECBATCH_DATABASE_URL": url, "OMP_NUM_THREADS": "1",
           "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0", "SPECBATCH_PROCESSES": "2"}
    lines = [{"custom_id": f"q{i}", "prompt": f"word {i} and", "max_tokens": 8 + 4 * i} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # every step 50 ms longer (tests/worker/slow_step_hook.py, in both children): the signal lands mid-job
    slow = "import tests.worker.slow_step_hook; from specbatch.cli.main import cli; cli()"
    proc = subprocess.Popen([sys.executable, "-c", slow, "run", str(tmp_path / "p.jsonl"), "--target",
                             str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"), "--no-cache"],
                            env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_results(url, 3, proc)
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "--resume" in err, err
    # a child's command line is the parent's: none is left
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "p.jsonl")], capture_output=True, text=True).stdout
    assert not left.split(), "a decode process outlived run"
    results, by = _counts(url)
    assert 3 <= results < 40 and by.get("completed", 0) == results
    assert by.get("running", 0) == 0 and results + by["pending"] == 40     # every claim handed back
    get_settings.cache_clear()
    job = json.loads(CliRunner().invoke(cli, ["jobs", "--json"], env={"SPECBATCH_DATABASE_URL": url}).output)[0]
    resumed = subprocess.run([EXE, "run", "--resume", job["id"], "--json"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _counts(url) == (40, {"completed": 40})


def test_ctrl_c_as_a_process_is_forked_does_not_reach_it(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ctrl-Cs that land in a child between its fork and its own handlers (simulated: it
    signals itself first) run nothing of the parent's there: no KeyboardInterrupt from its
    bootstrap (a traceback, a decode process ended with status 1); it is born with them blocked
    and ignores them once it unblocks them."""
    from specbatch.worker import forked

    real = forked._child

    def early(*args):   # noqa: ANN002, ANN202
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(forked, "_child", early)
    parent = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _run(url, str(_prompts(tmp_path / "p.jsonl", 30)), "--target", str(tiny_models / "llama"),
         "--processes", "2", "--no-cache")
    assert len(_results(url)[0]) == 34
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == parent     # this process's mask is back
