"""specbatch jobs / status / export / cancel / retry / db, through the real Click entry point."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from specbatch import db
from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.db.models import Job, Request, RequestStatus, Result
from specbatch.errors import BrokerUnavailable
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from tests.db.databases import head_revision

PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
COUNT_KEYS = {"total", "pending", "running", "completed", "failed", "cancelled"}


@pytest.fixture(autouse=True)
def db_url(tmp_path, monkeypatch) -> str:
    """Every test gets its own SQLite file (not created yet) and an unreachable broker."""
    url = f"sqlite:///{tmp_path / 'data' / 'cli.db'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    yield url
    db.forget_engines()


@pytest.fixture
def no_worker_check(monkeypatch) -> list[str]:
    """Replace the live-worker probe; records the queues asked about. Returns no worker."""
    import specbatch.worker.monitor as monitor

    asked: list[str] = []

    def fake(settings, queue, **_):
        asked.append(queue)
        return []

    monkeypatch.setattr(monitor, "queue_workers", fake)
    return asked


def run(*args: str):
    return CliRunner().invoke(cli, list(args), obj={})


def make_job(url: str, results: int = 2, failures: int = 1, pending: int = 1) -> tuple[str, list[int]]:
    """A job with ``results`` completed, ``failures`` failed and ``pending`` untouched requests."""
    from tests.jobs.test_store import output

    n = results + failures + pending
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(n)]
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue="sb.q1").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids[: results + failures], "w1", 60, 3)
        for i in ids[:results]:
            store.record_result(s, i, output(), "w1")
        for i in ids[results: results + failures]:
            store.record_failure(s, i, "boom", "w1")
        store.refresh_job(s, job_id)
    return job_id, ids


def statuses(url: str, job_id: str) -> list[str]:
    with db.session_factory(url).begin() as s:
        return [RequestStatus(x).value for x in
                s.scalars(select(Request.status).where(Request.job_id == job_id).order_by(Request.id))]


@pytest.mark.parametrize("command", [["jobs"], ["status"], ["export"], ["cancel"], ["retry"], ["db"],
                                     ["db", "upgrade"], ["db", "url"]])
def test_every_command_has_help_with_an_example(command):
    result = run(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output and "specbatch" in result.output.split("Example:")[1]


NO_DATABASE = ("Error: no database at {path} ({where}); nothing has been stored there yet: "
               "`specbatch run FILE` or `specbatch submit FILE` creates it")


@pytest.mark.parametrize("command", [["jobs"], ["jobs", "--json"], ["status", "abcd"], ["status", "abcd", "--json"],
                                     ["export", "abcd"], ["cancel", "abcd"], ["retry", "abcd"], ["resume", "abcd"],
                                     ["run", "--resume", "abcd"], ["cache", "stats"], ["cache", "clear"]],
                         ids=" ".join)
def test_a_command_on_existing_jobs_does_not_create_the_database(command, db_url, tmp_path):
    """Only submit / run FILE / serve / db upgrade create it: a read on a mistyped location must
    say where it looked, not create an empty database there and report "no jobs"."""
    result = run(*command)
    assert result.exit_code == 1, result.output
    path = tmp_path / "data" / "cli.db"
    assert result.stderr.strip() == NO_DATABASE.format(path=path, where="SPECBATCH_DATABASE_URL")
    if "--json" in command:     # the same failure, as JSON on stdout (README)
        assert json.loads(result.stdout) == {"error": {
            "message": result.stderr.strip().removeprefix("Error: "), "exit_code": 1, "errors": [], "total": 0}}
    else:
        assert result.stdout == ""
    assert not (tmp_path / "data").exists()            # neither the file nor its directory


def test_the_default_location_is_named_as_such(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECBATCH_DATABASE_URL")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    get_settings.cache_clear()
    result = run("jobs")
    assert result.exit_code == 1
    assert result.stderr.strip() == NO_DATABASE.format(
        path=tmp_path / "xdg" / "specbatch" / "specbatch.db", where="the default; SPECBATCH_DATABASE_URL picks another")
    assert not (tmp_path / "xdg").exists()


def test_a_relative_sqlite_path_says_so_and_how_to_write_an_absolute_one(monkeypatch, tmp_path):
    """sqlite:///tmp/x.db (three slashes) is tmp/x.db in the current directory: say where that is."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", "sqlite:///data/cli.db")
    get_settings.cache_clear()
    result = run("jobs")
    assert result.exit_code == 1
    assert result.stderr.strip() == NO_DATABASE.format(
        path=tmp_path / "data" / "cli.db",
        where="SPECBATCH_DATABASE_URL: sqlite:///data/cli.db is relative to the current directory; an absolute "
              "path takes four slashes, sqlite:////data/cli.db")
    assert not (tmp_path / "data").exists()


def test_submit_creates_the_database_and_says_where(db_url, tmp_path, monkeypatch):
    import specbatch.worker.enqueue as enqueue

    monkeypatch.setattr(enqueue, "check_broker", lambda settings: None)
    monkeypatch.setattr(enqueue, "enqueue_requests", lambda settings, job_id, ids, queue: 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    first = run("submit", str(prompts), "--target", "org/tgt", "--json")
    assert first.exit_code == 0, first.output
    assert f"created a new database at {tmp_path / 'data' / 'cli.db'}" in first.stderr
    listed = run("jobs", "--json")
    assert listed.exit_code == 0 and "created" not in listed.stderr
    assert [d["id"] for d in json.loads(listed.stdout)] == [json.loads(first.stdout)["id"]]


def test_an_empty_database_lists_no_jobs(db_url):
    assert run("db", "upgrade").exit_code == 0
    first = run("jobs")
    assert first.exit_code == 0 and "no jobs yet" in first.stdout
    assert json.loads(run("jobs", "--json").stdout) == []


def test_jobs_lists_newest_first(db_url):
    a, _ = make_job(db_url)
    b, _ = make_job(db_url, results=1, failures=0, pending=0)
    data = json.loads(run("jobs", "--json").stdout)
    assert [d["id"] for d in data] == [b, a]
    by_id = {d["id"]: d for d in data}
    assert by_id[a]["status"] == "running" and by_id[b]["status"] == "completed"
    assert by_id[a]["request_counts"] == {"total": 4, "pending": 1, "running": 0, "completed": 2, "failed": 1,
                                          "cancelled": 0}
    table = run("jobs")
    assert table.exit_code == 0 and a in table.stdout and "2/4" in table.stdout
    assert "batch" not in table.stdout.splitlines()[0]      # no API batch: no column for one


def test_jobs_shows_an_api_batchs_id_beside_its_job(db_url):
    """An openai-client user holds ``batch_...``; the list showed job ids only (qa57)."""
    a, _ = make_job(db_url)
    with db.session_factory(db_url).begin() as s:
        store.get_job(s, a).meta = {"batch_id": "batch_0123456789abcdef"}
    b, _ = make_job(db_url)
    lines = run("jobs").stdout.splitlines()
    assert lines[0].split()[:3] == ["id", "batch", "status"], lines
    assert next(x for x in lines if a in x).split()[1] == "batch_0123456789abcdef"
    assert next(x for x in lines if b in x).split()[1] == "running"


def test_status_json_and_warning_when_no_worker(db_url, no_worker_check):
    job_id, _ = make_job(db_url)
    result = run("status", job_id, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)                  # the warning is not mixed into the JSON
    assert data["id"] == job_id and data["status"] == "running"
    assert set(data["request_counts"]) == COUNT_KEYS and data["request_counts"]["completed"] == 2
    assert data["stats"]["tokens_generated"] == 6
    assert set(data["stats"]["acceptance_rate"]) == {"token_weighted", "request_mean"}
    assert no_worker_check == ["sb.q1"]
    assert "no live worker consumes queue sb.q1" in result.stderr


def test_status_table(db_url, no_worker_check):
    job_id, _ = make_job(db_url)
    result = run("status", job_id[:6])                  # a unique prefix is enough
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (f"job {job_id}", "running", "tgt <- d1", "completed 2", "failed 1", "acceptance rate",
                 "token-weighted", "request mean", "tokens generated", "p50", "p95", "w1", "line 3 (c2): boom",
                 f"`specbatch export {job_id} --status failed` lists every failure"):
        assert text in " ".join(out.split()), out


def test_status_words_a_count_of_one_in_the_singular(db_url, no_worker_check):
    """"(1 request)", "1 result copied", not "(1 requests)"; "(2 requests)" stays plural."""
    from tests.jobs.test_store import output

    reqs = [ParsedRequest(1, "a", "completion", "p", None, PARAMS, model="m-a"),
            ParsedRequest(2, "b", "completion", "p", None, PARAMS, model="m-b"),
            ParsedRequest(3, "c", "completion", "p", None, PARAMS, model="m-b")]
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue="sb.q1").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids[:2], "w1", 60, 3)
        store.record_result(s, ids[0], output(new_tokens=1), "w1")
        generated = s.scalars(select(Result).where(Result.request_id == ids[0])).one()
        store.record_cached_result(s, ids[1], generated, "w1")
        store.refresh_job(s, job_id)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "m-a: tgt <- d1 (1 request)" in out, out
    assert "m-b: tgt <- d1 (2 requests)" in out, out
    assert "1 result copied, 1 token not generated" in out, out
    assert "s (1 cache hit not counted)" in out, out        # beside the latency percentiles


def test_status_names_the_pair_once_where_body_model_names_the_target(db_url, no_worker_check):
    reqs = [ParsedRequest(1, "a", "completion", "p", None, PARAMS, model="tgt"),
            ParsedRequest(2, "b", "completion", "p", None, PARAMS, model="alias")]
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue="sb.q1").id
    out = " ".join(run("status", job_id).stdout.split())
    assert out.count("tgt <- d1") == 2, out            # the job's pair, and the alias routed to it
    assert "alias: tgt <- d1 (1 request)" in out and "tgt: tgt" not in out, out


def test_other_messages_word_a_count_of_one_in_the_singular(db_url, tmp_path, monkeypatch):
    import specbatch.worker.enqueue as enqueue

    monkeypatch.setattr(enqueue, "enqueue_requests", lambda settings, job_id, ids, queue: 1)
    job_id, _ = make_job(db_url, results=1, failures=1, pending=0)
    out = tmp_path / "one.csv"
    result = run("export", job_id, "-f", "csv", "-o", str(out), "--status", "completed")
    assert f"wrote 1 row to {out}" in result.stderr, result.output
    assert run("retry", job_id).stdout.strip() == f"job {job_id}: 1 failed request queued again on sb.q1"


def test_status_of_a_finished_job_does_not_probe_workers(db_url, monkeypatch):
    import specbatch.worker.monitor as monitor

    def boom(*a, **k):
        raise AssertionError("probed the broker for a finished job")

    monkeypatch.setattr(monitor, "queue_workers", boom)
    job_id, _ = make_job(db_url, results=1, failures=0, pending=0)
    result = run("status", job_id, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "completed"


def test_status_unknown_job_is_one_line_exit_1(db_url):
    run("db", "upgrade")
    result = run("status", "nope")
    assert result.exit_code == 1
    assert result.stderr.strip() == "Error: no job 'nope'; `specbatch jobs` lists the jobs"


def test_usage_errors_exit_2(db_url, monkeypatch):
    assert run("status").exit_code == 2
    assert run("export", "x", "--format", "xml").exit_code == 2
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", "not a url")
    get_settings.cache_clear()
    result = run("jobs")
    assert result.exit_code == 2 and "is not a database URL" in result.stderr


def test_export_to_a_reader_that_goes_away_stops_quietly(db_url):
    """`specbatch export JOB | head`: no "cannot write <_io.TextIOWrapper ...>" error, no traceback."""
    import subprocess
    import sys

    job_id, _ = make_job(db_url, results=600, failures=0, pending=0)   # > a 64 KiB pipe buffer
    proc = subprocess.Popen([sys.executable, "-c", "from specbatch.cli.main import main; main()", "export", job_id],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(200)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err        # 128 + SIGPIPE, as a shell tool reports it
    assert first.startswith(b'{"id": "batch_req_') and err == ""


def test_export_formats_and_filters(db_url, tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    job_id, _ = make_job(db_url)
    result = run("export", job_id)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert [x["custom_id"] for x in lines] == ["c0", "c1", "c2"]          # pending left out
    body = lines[0]["response"]["body"]
    assert body["choices"][0]["text"] == "out" and "acceptance_rate" in body["specbatch"]

    only = run("export", job_id, "--status", "failed,pending")
    assert [json.loads(x)["custom_id"] for x in only.stdout.splitlines()] == ["c2", "c3"]
    assert run("export", job_id, "--status", "done").exit_code == 2

    out = tmp_path / "sub" / "r.csv"
    result = run("export", job_id, "-f", "csv", "-o", str(out), "--status", "completed", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"id": job_id, "format": "csv", "path": str(out), "rows": 2}
    assert len(out.read_text().splitlines()) == 3

    monkeypatch.chdir(tmp_path)
    result = run("export", job_id, "-f", "parquet")
    assert result.exit_code == 0, result.output
    assert f"wrote 4 rows to {job_id}.parquet" in result.stderr
    assert list(pd.read_parquet(tmp_path / f"{job_id}.parquet")["custom_id"]) == ["c0", "c1", "c2", "c3"]
    assert run("export", job_id, "-f", "parquet", "-o", "-").exit_code == 2


def test_export_format_follows_the_output_extension(db_url, tmp_path):
    pd = pytest.importorskip("pandas")
    job_id, _ = make_job(db_url)
    csv_out = tmp_path / "out.csv"
    result = run("export", job_id, "-o", str(csv_out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["format"] == "csv"
    assert csv_out.read_text().startswith("job_id,request_id,sample_index,custom_id,")

    # --force over a real parquet file keeps it parquet (it used to become JSONL)
    pq_out = tmp_path / "answers.parquet"
    assert run("export", job_id, "-o", str(pq_out)).exit_code == 0
    result = run("export", job_id, "-o", str(pq_out), "--force", "--status", "completed")
    assert result.exit_code == 0, result.output
    assert list(pd.read_parquet(pq_out)["custom_id"]) == ["c0", "c1"]
    assert run("export", job_id, "-o", str(tmp_path / "a.PQ"), "--json").stdout.count('"parquet"') == 1

    other = tmp_path / "out.xlsx"       # an extension that names no format: jsonl, and a warning says so
    result = run("export", job_id, "-o", str(other))
    assert result.exit_code == 0, result.output
    assert f"warning: {other}: .xlsx names no export format; writing jsonl" in result.stderr
    assert json.loads(other.read_text().splitlines()[0])["custom_id"] == "c0"
    assert "names no export format" not in run("export", job_id, "-o", str(tmp_path / "plain")).stderr
    assert run("export", job_id, "-f", "csv", "-o", str(tmp_path / "same.csv")).exit_code == 0


@pytest.mark.parametrize("name", ["x.jsonl", "x.parquet"])
def test_an_export_that_cannot_be_written_names_the_users_file_not_its_temporary(db_url, name):
    """It said "cannot write /proc/.x.jsonl.15655.tmp" (qa57): the file the write goes through."""
    job_id, _ = make_job(db_url)
    result = run("export", job_id, "-o", f"/proc/{name}")
    assert result.exit_code == 1 and f"Error: cannot write /proc/{name}: " in result.stderr, result.output
    assert ".tmp" not in result.stderr


def test_export_of_an_unfinished_job_says_which_requests_it_left_out(db_url, tmp_path):
    """A dataset exported while its job runs must not pass for the whole job: the pending and
    running requests it leaves out are counted on stderr (exit 0, stdout untouched)."""
    job_id, _ = make_job(db_url, results=2, failures=0, pending=2)    # queued: 2 of 4 not finished
    out = tmp_path / "answers.jsonl"
    result = run("export", job_id, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 2
    assert (f"warning: job {job_id} is running: 2 requests not finished yet are not in the file "
            f"(`specbatch status {job_id} --watch` waits for the job to end") in result.stderr
    to_stdout = run("export", job_id)
    assert len(to_stdout.stdout.splitlines()) == 2 and "2 requests not finished yet" in to_stdout.stderr
    # asked for (--status, or csv/parquet's default: every request), or nothing left: no warning
    assert "warning" not in run("export", job_id, "--status", "completed,pending").stderr
    assert "warning" not in run("export", job_id, "-f", "csv").stderr
    done, _ = make_job(db_url, results=1, failures=1, pending=0)
    assert "warning" not in run("export", done).stderr


def test_export_of_an_interrupted_run_says_interrupted_and_how_to_finish_it(db_url, tmp_path):
    """A `specbatch run` stopped by Ctrl-C leaves its job "interrupted" (as `status` shows it): the
    export's warning must say so and point at `run --resume`, not at `status --watch`, which would
    wait for a run that no longer exists (qa51)."""
    job_id, _ = make_job(db_url, results=2, failures=0, pending=2)
    with db.session_factory(db_url).begin() as s:
        store.get_job(s, job_id).meta = {"embedded": True}
        store.set_interrupted(s, job_id, True)
    result = run("export", job_id, "-o", str(tmp_path / "part.jsonl"))
    assert result.exit_code == 0, result.output
    assert (f"warning: job {job_id} is interrupted: 2 requests not finished yet are not in the file "
            f"(`specbatch run --resume {job_id}` finishes them") in result.stderr, result.stderr
    assert "--watch" not in result.stderr


def test_export_format_that_contradicts_the_extension_is_a_usage_error(db_url, tmp_path):
    job_id, _ = make_job(db_url)
    out = tmp_path / "out.csv"
    result = run("export", job_id, "-f", "jsonl", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: -f jsonl but {out} ends in .csv: drop -f or change the name")
    assert not out.exists()
    assert run("export", job_id, "--format", "csv", "-o", str(tmp_path / "x.parquet")).exit_code == 2


def test_cancel(db_url):
    job_id, ids = make_job(db_url)
    result = run("cancel", job_id)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"job {job_id} cancelled: 1 pending request dropped, 2 results kept"
    assert statuses(db_url, job_id) == ["completed", "completed", "failed", "cancelled"]
    again = run("cancel", job_id, "--json")
    assert json.loads(again.stdout)["status"] == "cancelled"
    assert run("cancel", job_id).stdout.strip() == f"job {job_id} is already cancelled; nothing to cancel"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cancel_drops_at_once_the_rows_of_a_worker_killed_on_this_machine(db_url):
    """A worker SIGKILLed mid-job leaves its rows running on a live lease (minutes): cancel used to
    wait 10 s, say they were "still running" and leave the job cancelling until the lease ran out.
    Rows of a holder that still runs, or of one on another machine, are left to their worker."""
    import os
    import socket

    job_id, ids = make_job(db_url, results=0, failures=0, pending=4)
    here = socket.gethostname()
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids[:2], f"specbatch-1@{here}:{_dead_pid()}", 300, 3)
    result = run("cancel", job_id)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (f"job {job_id} cancelled: 2 pending requests dropped, 2 running requests of "
                                     "a worker that is no longer running dropped, 0 results kept")
    assert statuses(db_url, job_id) == ["cancelled"] * 4
    assert json.loads(run("status", job_id, "--json").stdout)["status"] == "cancelled"

    live, _ = make_job(db_url, results=0, failures=0, pending=3)
    with db.session_factory(db_url).begin() as s:
        rows = store.resumable_request_ids(s, live)
        store.claim_requests(s, rows[:1], f"specbatch-1@{here}:{os.getpid()}", 300, 3)
        store.claim_requests(s, rows[1:2], f"specbatch-1@elsewhere.example:{_dead_pid()}", 300, 3)
    import specbatch.cli.jobs as jobs_cli

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jobs_cli, "CANCEL_WAIT", 0.0)
        result = run("cancel", live)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"job {live} is cancelling: 1 pending request dropped; "), result.output
    assert statuses(db_url, live) == ["running", "running", "cancelled"]


def test_retry_requeues_only_failed_requests(db_url, monkeypatch):
    import specbatch.worker.enqueue as enqueue

    calls = []
    monkeypatch.setattr(enqueue, "enqueue_requests",
                        lambda settings, job_id, ids, queue: calls.append((job_id, list(ids), queue)) or 1)
    job_id, ids = make_job(db_url, results=1, failures=2, pending=0)
    result = run("retry", job_id, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"id": job_id, "retried": 2, "request_ids": ids[1:], "queue": "sb.q1",
                                         "tasks": 1}
    assert calls == [(job_id, ids[1:], "sb.q1")]
    assert statuses(db_url, job_id) == ["completed", "pending", "pending"]
    nothing = run("retry", job_id)
    assert nothing.exit_code == 0 and "no failed requests; nothing to retry" in nothing.stdout


def test_retry_with_the_broker_down_leaves_requests_pending(db_url, monkeypatch):
    import specbatch.worker.enqueue as enqueue

    def down(*a, **k):
        raise BrokerUnavailable("cannot reach redis://127.0.0.1:1/0")

    monkeypatch.setattr(enqueue, "enqueue_requests", down)
    job_id, _ = make_job(db_url, results=1, failures=1, pending=0)
    result = run("retry", job_id)
    assert result.exit_code == 1
    assert "the broker is unreachable" in result.stderr and f"specbatch resume {job_id}" in result.stderr
    assert statuses(db_url, job_id) == ["completed", "pending"]


def _id_unreadable(monkeypatch) -> None:
    """The database stops answering as a command reads its id (db.database_id), which the tasks it
    sends name their job's database by."""
    import psycopg
    from sqlalchemy.exc import OperationalError

    def lost(url: str) -> str:
        raise OperationalError("SELECT specbatch_database.id", {}, psycopg.OperationalError("server closed the connection"))

    monkeypatch.setattr(db, "database_id", lost)


def test_submit_reads_the_database_id_before_it_writes_the_job(db_url, tmp_path, monkeypatch):
    """The id was read at the first send, after the job was written: a database lost there (or one
    whose id this role may not read) left a job saved and unsent under "run the command again",
    and submitting again made a second job of the same file (review53b)."""
    import specbatch.worker.enqueue as enqueue

    monkeypatch.setattr(enqueue, "check_broker", lambda settings: None)
    _id_unreadable(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = run("submit", str(prompts), "--target", "org/tgt")
    assert result.exit_code == 1
    assert "the database stopped answering (server closed the connection)" in result.stderr, result.output
    with db.session_factory(db_url).begin() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_retry_reads_the_database_id_before_it_changes_a_request(db_url, monkeypatch):
    """As submit: its failed requests were made pending before the id was read, so running it again
    said "no failed requests; nothing to retry" of requests no task named (review53b)."""
    job_id, _ = make_job(db_url, results=1, failures=1, pending=0)
    _id_unreadable(monkeypatch)
    result = run("retry", job_id)
    assert result.exit_code == 1
    assert "the database stopped answering (server closed the connection)" in result.stderr, result.output
    assert statuses(db_url, job_id) == ["completed", "failed"]


def test_db_upgrade_and_url(db_url, tmp_path):
    result = run("db", "upgrade")
    assert result.exit_code == 0, result.output
    assert f"created a new database at {tmp_path / 'data' / 'cli.db'}" in result.stderr
    assert result.stdout.strip() == f"database {db_url} migrated from an empty schema to revision {head_revision()}"
    # stop 50's leftover: the same line whether or not anything was migrated
    again = run("db", "upgrade")
    assert again.stdout.strip() == f"database {db_url} is at revision {head_revision()} already (the newest): " \
        "nothing to migrate"
    assert json.loads(run("db", "upgrade", "--json").stdout) == {"url": db_url, "revision": head_revision(),
                                                                 "previous": head_revision()}
    db.downgrade(db_url, "-1")
    older = db.current_revision(db_url)
    assert older != head_revision()
    db.forget_engines()     # as a new process finds it: no engine cached (one would migrate on first use)
    assert run("db", "upgrade").stdout.strip() == f"database {db_url} migrated from {older} to revision {head_revision()}"
    # an existing empty file (as an empty PostgreSQL database): migrated, not "nothing to migrate"
    db.forget_engines()
    path = tmp_path / "data" / "cli.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.touch()
    assert run("db", "upgrade").stdout.strip() == \
        f"database {db_url} migrated from an empty schema to revision {head_revision()}"
    assert json.loads(run("db", "url", "--json").stdout) == {"url": db_url, "path": str(tmp_path / "data" / "cli.db"),
                                                             "exists": True}


def test_submit_of_a_bad_file_writes_nothing(db_url, tmp_path, monkeypatch):
    import specbatch.worker.enqueue as enqueue

    monkeypatch.setattr(enqueue, "check_broker", lambda settings: None)
    make_job(db_url)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y", "top_p": 2}\n')
    with db.session_factory(db_url).begin() as s:
        before = (s.scalar(select(func.count()).select_from(Job)), s.scalar(select(func.count()).select_from(Request)))
    result = run("submit", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:2: top_p: must be in [0, 1] (0: the most likely token only), got 2" in result.stderr
    with db.session_factory(db_url).begin() as s:
        after = (s.scalar(select(func.count()).select_from(Job)), s.scalar(select(func.count()).select_from(Request)))
    assert after == before


def test_submit_json_answers_a_bad_file_in_json(db_url, tmp_path, monkeypatch):
    """With --json, a file that fails validation is a JSON document on stdout (each problem with its
    file, line and field), not only lines for people on stderr; the exit status stays 1."""
    import specbatch.worker.enqueue as enqueue

    monkeypatch.setattr(enqueue, "check_broker", lambda settings: None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y", "top_p": 2}\nnot json\n')
    result = run("submit", str(bad), "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"error": {
        "message": "3 errors; nothing was written", "exit_code": 1, "total": 3, "errors": [
            {"file": str(bad), "line": 2, "field": "top_p", "message": "must be in [0, 1] (0: the most likely token only), got 2"},
            {"file": str(bad), "line": 2, "field": "custom_id",
             "message": 'duplicate "a" (first on line 1)'},
            {"file": str(bad), "line": 3, "field": None, "message": "invalid JSON: Expecting value (column 1)"}]}}
    assert f"{bad}:2: top_p: must be in [0, 1] (0: the most likely token only), got 2" in result.stderr      # people still read stderr


@pytest.mark.parametrize("args, code, field, message", [
    (["--temperature", "9"], 2, "--temperature",
     "Invalid value for '--temperature': 9.0 is not in the range 0<=x<=2."),
    (["--target", "gpt-9"], 1, None, "model 'gpt-9' not found"),
    # a known draft of another tokenizer family than the default target: `run`'s line, no job
    (["--draft", "qwen2.5-coder-0.5b"], 1, None,
     "draft 'qwen2.5-coder-0.5b' does not share the tokenizer of target 'smollm2-135m'"),
], ids=["usage", "model", "tokenizer"])
def test_submit_json_answers_every_failure_in_json(db_url, tmp_path, args, code, field, message):
    """A bad option (click refuses it before the command runs) or model: JSON on stdout too."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = run("submit", str(prompts), "--json", *args)
    assert result.exit_code == code
    error = json.loads(result.stdout)["error"]
    assert error["exit_code"] == code and error["message"].startswith(message)
    assert error["errors"] == ([{"file": None, "line": None, "field": field, "message": message}] if field else [])
    assert not (tmp_path / "data").exists()             # nothing stored


def test_status_shows_the_users_text_as_text_not_markup(db_url, no_worker_check):
    reqs = [ParsedRequest(1, "[/q1]", "completion", "p", None, PARAMS, model="[bold]m")]
    with db.session_factory(db_url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs,
                                  queue="sb.q1", source="data[train].jsonl").id
        (rid,) = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, [rid], "w1", 60, 3)
        store.record_failure(s, rid, "bad [red]value[/red]", "w1")
        store.refresh_job(s, job_id)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    for text in ("line 1 ([/q1]): bad [red]value[/red]", "[bold]m: tgt <- d1", "data[train].jsonl"):
        assert text in out, out


def test_failure_lines_show_the_first_failures_and_count_the_rest():
    from specbatch.cli.render import failure_lines

    d = {"id": "j1", "request_counts": {"failed": 7},
         "failures": [{"line_no": 2, "custom_id": "a", "error": "prompt too long"}]}
    assert failure_lines(d) == ["line 2 (a): prompt too long",
                                "and 6 more; `specbatch export j1 --status failed` lists every failure"]
    assert failure_lines({"id": "j1", "request_counts": {"failed": 0}, "failures": []}) == []


def test_status_says_how_many_requests_a_dead_worker_left_with_expired_leases(db_url, no_worker_check):
    from datetime import timedelta

    from specbatch.db.models import utcnow

    job_id, ids = make_job(db_url, results=1, failures=0, pending=3)
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids[1:3], "w-dead", 60, 3)
        s.execute(Request.__table__.update().where(Request.id.in_(ids[1:3]))
                  .values(lease_expires_at=utcnow() - timedelta(seconds=5)))
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert "2 requests stranded: 2 running requests on an expired lease" in result.stderr
    assert "being recovered" in result.stderr
    assert f"specbatch resume {job_id}" in result.stderr
    with db.session_factory(db_url).begin() as s:     # a live lease is not stranded
        store.claim_requests(s, ids[1:3], "w-live", 60, 3)
    assert "expired lease" not in run("status", job_id).stderr


def test_status_says_when_running_requests_are_held_by_a_worker_killed_on_this_machine(db_url, no_worker_check):
    """A SIGKILLed worker's rows stay running on a live lease (minutes): status said only "running
    2" (walk3 QA). It names the gone holder and `resume`, and changes nothing (read-only)."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                       # a pid that ran here and has exited
    holder = f"celery@{socket.gethostname()}:{dead.pid}"
    job_id, ids = make_job(db_url, results=1, failures=0, pending=3)
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids[1:3], holder, 300, 3)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert f"2 running requests held by a worker that no longer runs on this machine ({holder})" in result.stderr
    assert f"`specbatch resume {job_id}` takes them back now" in result.stderr
    with db.session_factory(db_url).begin() as s:      # status expired nothing
        assert len(store.leased_requests(s, job_id)) == 2
    with db.session_factory(db_url).begin() as s:      # a live holder is not named
        store.release_requests(s, ids[1:3])
        store.claim_requests(s, ids[1:3], f"celery@{socket.gethostname()}:{os.getpid()}", 300, 3)
    assert "no longer runs" not in run("status", job_id).stderr


def test_status_names_a_starting_worker_instead_of_asking_for_another(db_url, monkeypatch):
    """A worker loading its models is online, not consuming yet: status says it is starting and
    shows a consuming worker's compile progress, and never tells the user to start a second one."""
    import specbatch.worker.monitor as monitor

    views = [monitor.WorkerView("w1@h", False, "starting: loading models")]
    monkeypatch.setattr(monitor, "queue_workers", lambda settings, queue, **_: views)
    job_id, _ = make_job(db_url)
    result = run("status", job_id, "--json")
    assert result.exit_code == 0, result.output
    assert "worker w1@h is starting for queue sb.q1 (starting: loading models)" in result.stderr
    assert "no live worker" not in result.stderr and json.loads(result.stdout)["id"] == job_id

    views[:] = [monitor.WorkerView("w1@h", True, "compiling 2/4 (t graph 2/4), decoding eagerly until then")]
    result = run("status", job_id, "--json")
    assert "worker w1@h: compiling 2/4 (t graph 2/4), decoding eagerly until then" in result.stderr
    assert "no live worker" not in result.stderr and "starting" not in result.stderr

    why = "compiling gains 1.05x at 8 rows (measured here at the last warm-up); auto compiles only above 1.05x"
    views[:] = [monitor.WorkerView("w1@h", True, f"eager: auto: {why}")]
    result = run("status", job_id, "--json")     # decoding, in words a user reads as that
    assert f"worker w1@h: decoding, not compiled: {why}\n" in result.stderr, result.stderr


def test_status_names_a_paused_worker_and_warns_that_nothing_consumes(db_url, monkeypatch):
    """A worker online for the job's queue that stopped consuming it (a refused task, the database
    down, target failures) is named as paused, pointing at its log, not as decoding (qa53)."""
    import specbatch.worker.monitor as monitor

    views = [monitor.WorkerView("w1@h", False, "eager: auto: compiling gains 1.05x", paused=True)]
    monkeypatch.setattr(monitor, "queue_workers", lambda settings, queue, **_: views)
    job_id, _ = make_job(db_url)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert ("warning: worker w1@h is online for queue sb.q1 but does not consume it: it paused itself "
            "(its log's 'paused:' line says why)") in result.stderr, result.stderr
    assert "warning: no live worker consumes queue sb.q1" in result.stderr
    assert "decoding" not in result.stderr and "is starting" not in result.stderr


def test_status_names_a_worker_of_another_database_and_warns_that_nothing_consumes(db_url, monkeypatch):
    """A worker consuming the job's queue but reading another database passes its tasks on unrun
    (docs/DESIGN.md, "Tasks of another database"): status says so, with the fix, and that no live
    worker consumes the queue. One of this database, or one that says nothing of its database (an
    older worker), reads as before."""
    import specbatch.worker.monitor as monitor

    views = [monitor.WorkerView("w1@h", True, "eager: auto: x", database="0" * 32)]
    monkeypatch.setattr(monitor, "queue_workers", lambda settings, queue, **_: views)
    job_id, _ = make_job(db_url)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert (f"warning: worker w1@h consumes queue sb.q1 but reads another database (id {'0' * 32}; this one's "
            f"is {db.database_id(db_url)}): it passes this database's tasks on unrun; give it the "
            "SPECBATCH_DATABASE_URL this command uses") in result.stderr, result.stderr
    assert "warning: no live worker consumes queue sb.q1" in result.stderr
    for same in (db.database_id(db_url), None):
        views[:] = [monitor.WorkerView("w1@h", True, "eager: auto: x", database=same)]
        result = run("status", job_id)
        assert "another database" not in result.stderr and "no live worker" not in result.stderr, result.stderr


def test_resume_of_a_cancelled_or_finished_job_says_so_without_the_broker(db_url):
    """Not "re-enqueued 0 requests" (exit 0, after a worker check on the broker): a cancelled job is
    refused as `retry` refuses it, one with nothing left says so (the broker here is unreachable)."""
    cancelled, _ = make_job(db_url)
    assert run("cancel", cancelled).exit_code == 0
    result = run("resume", cancelled)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: job {cancelled} is cancelled; a cancelled job cannot be resumed (submit the file again)")

    finished, _ = make_job(db_url, results=2, failures=1, pending=0)
    result = run("resume", finished)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"job {finished} is completed_with_errors; nothing to resume"
    assert result.stderr == ""


def test_resume_imports_no_model_library(db_url):
    """`specbatch resume` took 12 s where `status` took 2.5 s: it imported torch and transformers
    (through the in-process runner) to release a dead `run` process's rows. A fresh interpreter, as a
    user's shell starts it."""
    import os
    import subprocess
    import sys

    job_id, _ = make_job(db_url, results=2, failures=0, pending=0)
    code = ("import sys\n"
            "from click.testing import CliRunner\n"
            "from specbatch.cli.main import cli\n"
            f"r = CliRunner().invoke(cli, ['resume', '{job_id}'], obj={{}})\n"
            "print(r.exit_code, r.output.strip())\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    env = {**os.environ, "SPECBATCH_DATABASE_URL": db_url, "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"0 job {job_id} is completed; nothing to resume", "[]"]


def _fresh_cli(db_url: str, args: list[str]) -> list[str]:
    """``args`` through the real entry point in a fresh interpreter (as a user's shell starts it):
    exit code, stderr's last line, and which model libraries (and Alembic) it imported."""
    import os
    import subprocess
    import sys

    code = ("import sys\n"
            "from click.testing import CliRunner\n"
            "from specbatch.cli.main import cli\n"
            f"r = CliRunner().invoke(cli, {args!r}, obj={{}})\n"
            "print(r.exit_code, repr(r.exception) if not isinstance(r.exception, SystemExit) else None)\n"
            "print(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else '')\n"
            "print(sorted(m for m in ('torch', 'transformers', 'alembic') if m in sys.modules))\n")
    env = {**os.environ, "SPECBATCH_DATABASE_URL": db_url, "SPECBATCH_BROKER_URL": "redis://127.0.0.1:1/0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_status_and_cancel_import_no_model_library_and_no_alembic(db_url):
    """`status` and `cancel` took 9-14 s at load 10: 5 s of imports, 1.7 s of them Alembic's
    migration check (a database at head is told without it). Never torch or transformers."""
    job_id, _ = make_job(db_url)
    out = _fresh_cli(db_url, ["status", job_id])
    assert out[0] == "0 None" and out[2] == "[]", out
    assert _fresh_cli(db_url, ["cancel", job_id]) == ["0 None", "", "[]"]


def test_status_asks_the_workers_once(db_url, monkeypatch):
    """One remote-control broadcast per queue: each waits its whole timeout (1 s) for replies."""
    import specbatch.worker.monitor as monitor

    asked: list[str] = []
    monkeypatch.setattr(monitor, "_inspect", lambda settings, command, timeout: asked.append(command) or {})
    job_id, _ = make_job(db_url)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert "no live worker consumes queue sb.q1" in result.stderr
    assert asked == [monitor.VIEW_COMMAND]


def test_run_resume_of_no_job_answers_before_torch(db_url):
    """`run --resume BADID` said "no job" after 19 s: it imported torch and transformers (threads,
    the in-process runner) before reading the job. The id is checked first, in one line."""
    make_job(db_url, results=1, failures=0, pending=0)       # a database with another job in it
    assert _fresh_cli(db_url, ["run", "--resume", "BADID"]) == [
        "1 None", "Error: no job 'BADID'; `specbatch jobs` lists the jobs", "[]"]


def test_run_resume_of_a_finished_job_prints_its_summary_without_torch(db_url):
    job_id, _ = make_job(db_url, results=2, failures=0, pending=0)
    out = _fresh_cli(db_url, ["run", "--resume", job_id, "--json"])
    assert out == ["0 None", f"job {job_id}: nothing left to run (completed); its summary follows", "[]"]


def _job_with_steps(url: str, draft_steps: int, drafted: int, accepted: int, off: bool) -> str:
    """Two completed requests of 40 steps each, ``draft_steps`` of them drafting (0.1 s a verify)."""
    from specbatch.engine.types import GenerationOutput, GenerationStats

    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(2)]
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=["d1"], params={}, requests=reqs, queue="sb.q1").id
        ids = store.resumable_request_ids(s, job_id)
        store.claim_requests(s, ids, "w1", 60, 3)
        for i in ids:
            st = GenerationStats(prompt_tokens=5, new_tokens=40 + accepted, verify_steps=40, draft_steps=draft_steps,
                                 drafted_tokens=drafted, accepted_tokens=accepted, draft_seconds=0.1 * draft_steps,
                                 verify_seconds=4.0, wall_seconds=4.0 + 0.1 * draft_steps,
                                 speculation_disabled=off, batch_size_seconds={"2": 2.0})
            store.record_result(s, i, GenerationOutput("out", list(range(40 + accepted)), "length", st), "w1")
        store.refresh_job(s, job_id)
    return job_id


def test_status_says_in_numbers_why_speculation_was_switched_off(db_url):
    """A job whose draft drafted on 5% of its steps showed 'speculated 5% of steps' and no reason."""
    job_id = _job_with_steps(db_url, draft_steps=2, drafted=8, accepted=1, off=True)
    out = " ".join(run("status", job_id).stdout.split())
    assert ("speculation mostly plain: drafted on 4 of 80 steps (5%); the draft-length controller measured "
            "drafting slower than plain steps and turned it off for 2 requests; 4 drafted steps are too few to "
            "judge by: 1.50 tokens emitted (acceptance 12%), at least 2.0x a plain step's time") in out, out
    data = json.loads(run("status", job_id, "--json").stdout)["stats"]["speculation"]
    assert data == {"steps": 80, "drafted_steps": 4, "tokens_per_drafted_step": 1.5, "drafted_step_cost": 2.0,
                    "switched_off_requests": 2}


def test_status_says_why_a_draft_never_drafted(db_url):
    job_id = _job_with_steps(db_url, draft_steps=0, drafted=0, accepted=0, off=False)
    out = " ".join(run("status", job_id).stdout.split())
    assert "speculation off: none of 80 steps drafted; the autopilot decoded plainly and never tried" in out, out
    assert json.loads(run("status", job_id, "--json").stdout)["stats"]["speculation"]["drafted_steps"] == 0


def test_status_of_a_run_job_names_no_worker(db_url, monkeypatch, tmp_path):
    """A new-user walk: an interrupted `specbatch run` job was shown with a worker of this machine
    that consumes its pair's queue ("worker w1@h: decoding"); no worker ever takes a run job.
    Status says how it ends instead."""
    import os

    import specbatch.worker.monitor as monitor
    from specbatch.worker import scratch

    monkeypatch.setenv("SPECBATCH_READY_DIR", str(tmp_path / "ready"))
    get_settings.cache_clear()
    own = scratch.workers_root(get_settings()) / str(os.getpid())     # a live worker of sb.q1, here
    own.mkdir(parents=True)
    (own / scratch.WORKER_FILE).write_text(json.dumps({"name": "w1@h", "queue": "sb.q1",
                                                       "source": scratch.source(get_settings())}))
    (own / scratch.STATE_FILE).write_text("eager: off\n")
    monkeypatch.setattr(monitor, "_inspect", lambda settings, command, timeout: {})   # a broker, no replies
    job_id, _ = make_job(db_url)
    with db.session_factory(db_url).begin() as s:
        job = store.get_job(s, job_id)
        job.meta = {"embedded": True}
        store.set_interrupted(s, job_id, True)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert "w1@h" not in result.stderr and "no live worker" not in result.stderr, result.stderr
    assert (f"job {job_id} is run by `specbatch run`, not by workers; if that run has stopped, "
            f"`specbatch run --resume {job_id}` finishes it here") in result.stderr   # (one way, as run says)


def test_status_of_a_run_killed_on_this_machine_says_it_no_longer_runs(db_url, no_worker_check):
    """A `specbatch run` killed by SIGKILL (OOM, a closed terminal) leaves its job "running" with
    rows on a live lease: status said only "if that run has stopped" (qa51). Like a killed
    worker's, the gone run is named, with `run --resume`; a live run is not."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                       # a pid that ran here and has exited
    holder = f"embedded@{socket.gethostname()}:{dead.pid}"
    job_id, ids = make_job(db_url, results=1, failures=0, pending=3)
    with db.session_factory(db_url).begin() as s:
        store.get_job(s, job_id).meta = {"embedded": True}
        store.claim_requests(s, ids[1:3], holder, 300, 3)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert (f"job {job_id}'s `specbatch run` ({holder}) no longer runs on this machine: "
            f"`specbatch run --resume {job_id}` finishes it") in result.stderr, result.stderr
    assert "if that run has stopped" not in result.stderr
    with db.session_factory(db_url).begin() as s:      # a live run: the general line
        store.release_requests(s, ids[1:3])
        store.claim_requests(s, ids[1:3], f"embedded@{socket.gethostname()}:{os.getpid()}", 300, 3)
    result = run("status", job_id)
    assert "no longer runs" not in result.stderr and "if that run has stopped" in result.stderr


def test_export_of_a_run_killed_on_this_machine_points_at_run_resume(db_url, tmp_path):
    """The export of a killed `specbatch run`'s job said `status --watch` waits for it to end:
    nothing will ever end it (qa51). Its warning points at `run --resume`; a live run's does not."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job_id, ids = make_job(db_url, results=1, failures=0, pending=3)
    with db.session_factory(db_url).begin() as s:
        store.get_job(s, job_id).meta = {"embedded": True}
        store.claim_requests(s, ids[1:3], f"embedded@{socket.gethostname()}:{dead.pid}", 300, 3)
    result = run("export", job_id, "-o", str(tmp_path / "a.jsonl"))
    assert result.exit_code == 0, result.output
    assert (f"warning: job {job_id} is running: 3 requests not finished yet are not in the file "
            f"(`specbatch run --resume {job_id}` finishes them") in result.stderr, result.stderr
    with db.session_factory(db_url).begin() as s:      # a live run: it ends the job itself
        store.release_requests(s, ids[1:3])
        store.claim_requests(s, ids[1:3], f"embedded@{socket.gethostname()}:{os.getpid()}", 300, 3)
    result = run("export", job_id, "-o", str(tmp_path / "b.jsonl"))
    assert f"`specbatch status {job_id} --watch` waits for the job to end" in result.stderr, result.stderr


def _gone_run_job(url: str) -> tuple[str, list[int], str]:
    """A `specbatch run` job of /data/p.jsonl (1 of its 4 requests done, nothing held) and the
    name of a run process of this machine that has exited: (job id, request ids, that name)."""
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job_id, ids = make_job(url, results=1, failures=0, pending=3)
    with db.session_factory(url).begin() as s:
        job = store.get_job(s, job_id)
        job.meta, job.source = {"embedded": True}, "/data/p.jsonl"
    return job_id, ids, f"embedded@{socket.gethostname()}:{dead.pid}"


def test_a_run_killed_longer_than_a_lease_ago_is_still_named_as_stopped(db_url, tmp_path, no_worker_check):
    """A `specbatch run` killed (OOM, SIGKILL) more than SPECBATCH_LEASE_SECONDS ago: its rows stay
    running on the dead holder, on a lease long expired (no worker's sweep takes a run job's rows
    back). status, export and the next `run FILE` named it only while the lease lasted, 300 s:
    after that export pointed at `status --watch`, which waits for ever, and `run FILE` said nothing."""
    from datetime import timedelta

    from specbatch.db.models import utcnow
    from specbatch.worker.pids import gone_here

    job_id, ids, holder = _gone_run_job(db_url)
    with db.session_factory(db_url).begin() as s:
        store.claim_requests(s, ids[1:3], holder, 300, 3)
        s.execute(Request.__table__.update().where(Request.id.in_(ids[1:3]))
                  .values(lease_expires_at=utcnow() - timedelta(hours=1)))
    result = run("export", job_id, "-o", str(tmp_path / "a.jsonl"))
    assert result.exit_code == 0, result.output
    assert f"`specbatch run --resume {job_id}` finishes them" in result.stderr, result.stderr
    assert "--watch" not in result.stderr
    result = run("status", job_id)
    assert f"job {job_id}'s `specbatch run` ({holder}) no longer runs on this machine" in result.stderr, \
        result.stderr
    with db.session_factory(db_url).begin() as s:
        assert store.stopped_runs(s, "/data/p.jsonl", gone_here) == [(job_id, 3, "killed")]


def test_a_run_killed_while_it_held_no_rows_is_named_as_stopped(db_url, tmp_path, no_worker_check):
    """A `specbatch run` SIGKILLed while loading (a next --model-map pair, say) holds no rows: status,
    export and the next `run FILE` knew it only by its rows, and took it for a run still going
    (tidy52). The run names itself in the job first (``store.set_runner``); gone, it is named."""
    import socket

    from specbatch.worker.pids import gone_here

    job_id, ids, holder = _gone_run_job(db_url)
    with db.session_factory(db_url).begin() as s:
        store.set_runner(s, job_id, holder)
    result = run("status", job_id)
    assert result.exit_code == 0, result.output
    assert (f"job {job_id}'s `specbatch run` ({holder}) no longer runs on this machine: "
            f"`specbatch run --resume {job_id}` finishes it") in result.stderr, result.stderr
    result = run("export", job_id, "-o", str(tmp_path / "a.jsonl"))
    assert f"`specbatch run --resume {job_id}` finishes them" in result.stderr, result.stderr
    with db.session_factory(db_url).begin() as s:
        assert store.stopped_runs(s, "/data/p.jsonl", gone_here) == [(job_id, 3, "killed")]
        store.set_runner(s, job_id, f"embedded@{socket.gethostname()}:{os.getpid()}")   # a live run
    result = run("status", job_id)
    assert "no longer runs" not in result.stderr and "if that run has stopped" in result.stderr
    result = run("export", job_id, "-o", str(tmp_path / "b.jsonl"))
    assert f"`specbatch status {job_id} --watch` waits for the job to end" in result.stderr, result.stderr
    with db.session_factory(db_url).begin() as s:
        assert store.stopped_runs(s, "/data/p.jsonl", gone_here) == []
        store.set_runner(s, job_id, holder)                 # gone, but a live process holds rows
        store.claim_requests(s, ids[1:2], f"embedded@{socket.gethostname()}:{os.getpid()}", 300, 3)
        assert store.stopped_runs(s, "/data/p.jsonl", gone_here) == []


def test_a_run_that_still_loads_is_not_named_killed_when_a_second_run_of_its_job_is_gone(db_url, no_worker_check):
    """Two runs of one job (qa51: a `run --resume JOB` while the first still runs it): the second
    recorded itself over the first, so once it had exited (killed, or done with nothing left it
    could claim), the first, loading its next --model-map pair with no row held, read as killed
    in status, export and the next `run FILE` (review52). Every run of the job is recorded; the
    job reads as killed only when all of them are gone, and a run that ends takes its name back."""
    import socket

    from specbatch.worker.pids import gone_here

    job_id, _ids, second = _gone_run_job(db_url)
    first = f"embedded@{socket.gethostname()}:{os.getpid()}"       # alive: this process
    with db.session_factory(db_url).begin() as s:
        store.set_runner(s, job_id, first)
        store.set_runner(s, job_id, second)
        assert store.run_stopped(s, store.get_job(s, job_id), gone_here) is None
        assert store.stopped_runs(s, "/data/p.jsonl", gone_here) == []
        store.set_runner(s, job_id, first, running=False)          # the first ends: the second is gone
        assert store.run_stopped(s, store.get_job(s, job_id), gone_here) == "killed"
        store.set_runner(s, job_id, second, running=False)         # (had it ended, not been killed)
        assert store.run_stopped(s, store.get_job(s, job_id), gone_here) is None


@pytest.mark.parametrize("args, doing", [(("jobs",), "open"), (("db", "upgrade"), "migrate")])
def test_a_database_that_is_down_is_one_line(monkeypatch, args, doing):
    """psycopg's message goes on with "\\n\\tIs the server running ...": two lines (walk3 QA; `db
    upgrade` still printed them, tidy52). One line naming the host, never the password."""
    import socket

    with socket.socket() as s:           # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"postgresql+psycopg://u:s3cret@127.0.0.1:{port}/x")
    get_settings.cache_clear()
    result = run(*args)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"Error: cannot {doing} the database postgresql+psycopg://u:***@127.0.0.1:{port}/x: "), \
        result.stderr
    assert "Is the server running" in result.stderr and "s3cret" not in result.stderr
