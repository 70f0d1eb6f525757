"""Queue commands through the CLI: `specbatch run` with no broker at all, `submit` with the broker down."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", f"redis://127.0.0.1:{_closed_port()}/0")
    monkeypatch.setenv("SPECBATCH_CHUNK_SIZE", "2")


def _prompts(tmp_path: Path, n: int = 3, max_tokens: int = 6) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"custom_id": f"q{i}", "prompt": f"The quick brown fox {i}", "max_tokens": max_tokens}
             for i in range(n)]
    lines.append({"custom_id": "chat", "messages": [{"role": "user", "content": "hello"}],
                  "max_tokens": max_tokens})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_run_embedded_without_redis(tmp_path: Path, tiny_models: Path) -> None:
    """`specbatch run` does intake + generation + summary in-process; no broker is listening."""
    prompts = _prompts(tmp_path)
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial"), "--json",
                                      "--batch-size", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["status"] == "completed", summary
    assert summary["request_counts"]["completed"] == 4
    assert summary["request_counts"]["total"] == 4

    from specbatch.config import get_settings
    from specbatch.db import session_factory
    from specbatch.db.models import Result

    get_settings.cache_clear()
    with session_factory(get_settings().database_url).begin() as s:
        assert s.query(Result).count() == 4


def test_run_says_on_stderr_which_models_load(tmp_path: Path, tiny_models: Path) -> None:
    """The spinner is drawn only in a terminal: piped or logged, `run` said nothing while loading."""
    target = str(tiny_models / "llama")
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path, n=1, max_tokens=2)), "--target", target,
                                      "--draft", "none", "--json"])
    assert result.exit_code == 0, result.output
    assert f"loading {target} ...\n" in result.stderr, result.stderr
    assert "loading" not in result.stdout


def test_run_prints_summary_table(tmp_path: Path, tiny_models: Path) -> None:
    prompts = _prompts(tmp_path, n=1, max_tokens=4)
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial")])
    assert result.exit_code == 0, result.output
    assert "completed" in result.output and "specbatch export" in result.output
    # "speculation_disabled 0" stood above "speculation: off: none of 4 steps drafted"
    assert "speculation_disabled" not in result.stdout


def test_submit_with_broker_down_writes_nothing(tmp_path: Path, tiny_models: Path) -> None:
    prompts = _prompts(tmp_path, n=2)
    result = CliRunner().invoke(cli, ["submit", str(prompts), "--target", str(tiny_models / "llama")])
    assert result.exit_code != 0
    assert "cannot reach the broker" in result.output
    from specbatch.config import get_settings
    from specbatch.db import session_factory
    from specbatch.db.models import Job

    get_settings.cache_clear()
    with session_factory(get_settings().database_url).begin() as s:
        assert s.query(Job).count() == 0


@pytest.mark.parametrize("args", [["--target", "smolm2-135m"], ["--draft", "smollm2-135m-int9"],
                                  ["--model-map", "gpt-4o=qwen2.5-coder-1.5"]])
def test_submit_of_a_misspelt_known_model_fails_before_any_job(tmp_path: Path, args: list[str]) -> None:
    """A job on a name no worker can load would wait for a worker that never comes."""
    result = CliRunner().invoke(cli, ["submit", str(_prompts(tmp_path, n=1)), *args])
    assert result.exit_code in (1, 2), result.output
    assert "(did you mean " in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "specbatch.db").exists() or _no_jobs()


def _no_jobs() -> bool:
    from specbatch.config import get_settings
    from specbatch.db import session_factory
    from specbatch.db.models import Job

    get_settings.cache_clear()
    with session_factory(get_settings().database_url).begin() as s:
        return s.query(Job).count() == 0


def test_worker_help_lists_batch_size() -> None:
    result = CliRunner().invoke(cli, ["worker", "--help"])
    assert result.exit_code == 0 and "--batch-size" in result.output


def test_run_accepts_generation_values_at_their_bounds(tmp_path: Path, tiny_models: Path) -> None:
    """The closed ends of each range are job defaults like any other (bad ones: test_generate_cli)."""
    bounds = ["--temperature", "0", "--top-p", "1", "--top-k", "0", "--seed", str(2**63 - 1)]
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path, n=1, max_tokens=2)), "--target",
                                      str(tiny_models / "llama"), "--json", *bounds])
    assert result.exit_code == 0, result.output
    submitted = CliRunner().invoke(cli, ["submit", str(_prompts(tmp_path, n=1)), "--target",
                                         str(tiny_models / "llama"), "--temperature", "0.5", "--top-p",
                                         "1e-9", "--seed", "0"])
    assert submitted.exit_code == 1 and "cannot reach the broker" in submitted.output, submitted.output


def test_run_compile_auto_says_once_why_it_decodes_eagerly(tmp_path: Path, tiny_models: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-token job does not repay compiling: --compile auto decodes eagerly and says so in one
    stderr line (nothing in --json's stdout); --compile off says nothing, and neither does the
    default (auto unasked: its usual choice on a CPU, not news on every run; qa57)."""
    from specbatch.engine.compile import decision

    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path / "cache"))   # no recorded warm-up
    monkeypatch.setitem(decision.EXPECTED_SPEEDUP, "cpu", {1: 1.8, 16: 1.4})   # a device where it pays
    args = ["run", str(_prompts(tmp_path, n=1, max_tokens=2)), "--target", str(tiny_models / "llama"),
            "--draft", str(tiny_models / "llama-partial"), "--json"]
    auto = CliRunner().invoke(cli, [*args, "--compile", "auto"])
    assert auto.exit_code == 0, auto.output
    assert auto.stderr.count("specbatch: decoding eagerly: compiling would take about ") == 1, auto.stderr
    assert auto.stderr.count("; --compile on compiles anyway") == 1, auto.stderr
    assert "eagerly" not in auto.stdout
    off = CliRunner().invoke(cli, [*args, "--compile", "off"])
    assert off.exit_code == 0, off.output
    assert "eagerly" not in off.output
    from specbatch.config import get_settings

    monkeypatch.setenv("SPECBATCH_COMPILE", "auto")      # the default (tests/conftest.py sets off)
    get_settings.cache_clear()
    unasked = CliRunner().invoke(cli, args)
    get_settings.cache_clear()
    assert unasked.exit_code == 0, unasked.output
    assert "eagerly" not in unasked.output


@pytest.mark.parametrize("command", ["run", "submit"])
def test_logit_bias_outside_the_targets_vocabulary_writes_nothing(tmp_path: Path, tiny_models: Path,
                                                                   command: str) -> None:
    """The target's vocabulary is known before the job is written (run: the loaded target;
    submit: a local model's config), so a bad logit_bias key fails the file, FILE:LINE: field."""
    path = tmp_path / "bias.jsonl"
    lines = [{"custom_id": "ok", "prompt": "Hi", "logit_bias": {"383": 5}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Hi", "logit_bias": {"384": 5, "9999": -1}}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, [command, str(path), "--target", str(tiny_models / "llama")])
    assert result.exit_code == 1, result.output
    assert f"{path}:2: body.logit_bias.384: token id 384 is outside the target's vocabulary [0, 384)" in result.output
    assert f"{path}:2: body.logit_bias.9999: token id 9999" in result.output
    assert "Traceback" not in result.output
    listed = CliRunner().invoke(cli, ["jobs", "--json"])
    assert listed.exit_code != 0 or json.loads(listed.stdout) == []


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_token_id_prompt_outside_the_vocabulary_writes_nothing(tmp_path: Path, tiny_models: Path,
                                                                 command: str) -> None:
    """As a logit_bias key: a completions prompt given as token ids is checked against the target's
    vocabulary where it is known (walk8: the line became a job whose request failed, exit 3)."""
    path = tmp_path / "ids.jsonl"
    lines = [{"custom_id": "ok", "prompt": [5, 383]},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 384, 10**6]}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, [command, str(path), "--target", str(tiny_models / "llama")])
    assert result.exit_code == 1, result.output
    assert (f"{path}:2: body.prompt: token ids must be below the target's vocabulary size 384; "
            "item 1 is 384") in result.output
    listed = CliRunner().invoke(cli, ["jobs", "--json"])
    assert listed.exit_code != 0 or json.loads(listed.stdout) == []


@pytest.mark.parametrize("command", ["run", "submit"])
def test_logit_bias_outside_the_vocabulary_is_listed_with_the_files_other_errors(
        tmp_path: Path, tiny_models: Path, command: str) -> None:
    """One pass lists every problem: a key outside a local target's vocabulary is found at intake,
    not reported only once the file's other errors are fixed (issue 32)."""
    path = tmp_path / "bias.jsonl"
    lines = [{"custom_id": "bias", "prompt": "Hi", "logit_bias": {"9999": 5}},
             {"custom_id": "cold", "prompt": "Hi", "temperature": -1}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, [command, str(path), "--target", str(tiny_models / "llama")])
    assert result.exit_code == 1, result.output
    assert f"{path}:1: logit_bias.9999: token id 9999 is outside the target's vocabulary [0, 384)" in result.output
    assert f"{path}:2: temperature" in result.output, result.output


def test_draft_ngram_and_the_ngram_flag_are_one_pool(tmp_path: Path, tiny_models: Path) -> None:
    """--ngram adds the n-gram drafter to the pool; --draft ngram names it: the same job pool and
    queue either way, in the order parse_drafters gives."""
    prompts, target, draft = _prompts(tmp_path, n=1, max_tokens=4), str(tiny_models / "llama"), \
        str(tiny_models / "llama-partial")
    jobs = []
    for args in (["--draft", draft, "--ngram"], ["--draft", "ngram", "--draft", draft]):
        result = CliRunner().invoke(cli, ["run", str(prompts), "--target", target, *args, "--json"])
        assert result.exit_code == 0, result.output
        jobs.append(json.loads(result.stdout[result.stdout.index("{"):]))
    assert [(j["drafters"], j["drafts"], j["ngram"], j["queue"]) for j in jobs] == \
        [([draft, "ngram"], [draft], True, jobs[0]["queue"])] * 2
    assert jobs[0]["queue"].startswith("specbatch.llama+llama-partial+ngram.")


def test_a_drafter_not_available_is_refused_in_one_line(tmp_path: Path, tiny_models: Path) -> None:
    result = CliRunner().invoke(cli, ["run", str(_prompts(tmp_path, n=1)), "--target", str(tiny_models / "llama"),
                                      "--draft", "eagle:/heads"])
    assert result.exit_code == 1, result.output
    assert "drafter 'eagle:/heads': EAGLE heads" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "specbatch.db").exists() or _no_jobs()


def test_run_with_stderr_redirected_names_its_job_before_it_ends(tmp_path: Path, tiny_models: Path) -> None:
    """A bar written to a file is drawn only at its end: a redirected run says at its start which
    job runs, so `status JOB` can be asked meanwhile."""
    prompts = _prompts(tmp_path, n=1, max_tokens=4)
    result = CliRunner().invoke(cli, ["run", str(prompts), "--target", str(tiny_models / "llama"),
                                      "--draft", str(tiny_models / "llama-partial"), "--json"])
    assert result.exit_code == 0, result.output
    job_id = json.loads(result.stdout[result.stdout.index("{"):])["id"]
    early = [line for line in result.stderr.splitlines() if line.startswith(f"job {job_id}: 2 requests running")]
    assert early and f"specbatch status {job_id}" in early[0], result.stderr
    # before the bar's final line (which also names the job)
    assert result.stderr.index(early[0]) < result.stderr.rindex(f"job {job_id}")


def test_flower_on_a_busy_port_exits_1_with_one_line(tmp_path: Path) -> None:
    """As `serve` says it: Flower itself ended in a 38-line traceback (OSError: [Errno 98]).
    A subprocess: on success `flower` replaces its process with Flower's."""
    import os
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", "from specbatch.cli.main import main; main()", "flower", "--port",
                              str(port)],
                             env=os.environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (f"Error: cannot serve on 127.0.0.1:{port}: Address already in use; "
                                           "pick another --port or stop what listens there"), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("address", ["0.0.0.0", "192.168.1.5", "flower.example"])
def test_flower_refuses_a_non_loopback_address_without_a_password(address: str, monkeypatch) -> None:
    """As `serve` refuses one without keys (walk3 QA: `flower --address 0.0.0.0` only warned)."""
    import os

    from click.testing import CliRunner

    from specbatch.cli.main import cli
    from specbatch.config import get_settings

    def started(*_: object) -> None:        # (never replace the test process with Flower)
        raise AssertionError("Flower started")

    monkeypatch.setattr(os, "execve", started)
    monkeypatch.delenv("SPECBATCH_FLOWER_PASSWORD", raising=False)
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["flower", "--address", address, "--port", "0"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (f"Error: refusing to run Flower on {address} without a password: "
                                              "set SPECBATCH_FLOWER_PASSWORD or bind 127.0.0.1")


def test_a_second_worker_of_one_name_on_this_machine_is_refused(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`specbatch worker -n gpu0@%h` run twice on one machine started both, silently (Celery's
    mingle, which warns of a duplicate name, is off): remote control reached both by one name (one
    refused a task and both stopped consuming), Flower showed one row for two (qa53). The second
    is refused in one line, before it waits for the broker; another name goes on."""
    import os

    from specbatch.config import get_settings
    from specbatch.worker import scratch

    monkeypatch.setenv("SPECBATCH_READY_DIR", str(tmp_path))
    monkeypatch.setenv("SPECBATCH_BROKER_WAIT_SECONDS", "0")
    get_settings.cache_clear()
    first = scratch.workers_root(get_settings()) / str(os.getppid())     # a live process: the first one
    first.mkdir(parents=True)
    scratch.write_worker(first, f"gpu0@{socket.gethostname()}", "q", get_settings())
    result = CliRunner().invoke(cli, ["worker", "-n", "gpu0@%h"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"Error: a worker named gpu0@{socket.gethostname()} already runs on this machine (pid {os.getppid()}), "
        "on the same broker and database; give this one another name (-n NAME@%h)")
    result = CliRunner().invoke(cli, ["worker", "-n", "gpu1@%h"])
    assert result.exit_code == 1 and "cannot reach the broker" in result.output, result.output


@pytest.mark.parametrize("target", ["gpt-9", "no/such-dir/x.gguf"])
def test_a_worker_of_a_name_that_is_no_model_is_refused_before_it_starts(tmp_path: Path, monkeypatch, target) -> None:  # noqa: ANN001
    """`specbatch worker --target gpt-9` was not checked until its pool child loaded: it waited for
    the broker, printed Celery's banner, and said 'cannot load models' three times, the last as a
    'WARNING celery.redirected' log line (qa53). Now one line, before the broker is asked, as
    `run` and `submit` refuse the name."""
    monkeypatch.setenv("SPECBATCH_READY_DIR", str(tmp_path))
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:9/0")     # nothing listens: never reached
    monkeypatch.setenv("SPECBATCH_BROKER_WAIT_SECONDS", "0")
    result = CliRunner().invoke(cli, ["worker", "--target", target, "--draft", "none"])
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"Error: worker not started, cannot load models: model {target!r} ") \
        or line.startswith(f"Error: worker not started, cannot load models: model file {target!r} does not exist"), line
