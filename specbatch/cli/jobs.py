"""Commands over the job store: jobs, status, export, cancel, retry, db."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from specbatch.cli.common import check_queue_workers, database_error, open_db, shown_url, warn
from specbatch.cli.json_out import echo_json
from specbatch.cli.render import (
    batching_line,
    counts_line,
    failure_lines,
    models,
    num,
    speculation_line,
    when,
)
from specbatch.config import Settings, get_settings
from specbatch.db.models import REQUEST_STATUSES
from specbatch.errors import BrokerUnavailable
from specbatch.jobs.export import FORMATS
from specbatch.plural import plural

logger = logging.getLogger(__name__)

JSON_HELP = "Print machine-readable JSON on stdout."


def _console() -> Any:
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False)


# ---------------------------------------------------------------- jobs


@click.command()
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1),
              help="How many jobs to show, newest first.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def jobs(limit: int, as_json: bool) -> None:
    """List jobs, newest first.

    \b
    Example:
      specbatch jobs --limit 10
      specbatch jobs --json | jq -r '.[] | select(.status == "running") | .id'
    """
    from specbatch.jobs import store

    with open_db(get_settings(), readonly=True).begin() as s:
        rows = store.list_jobs(s, limit=limit)
        counts = store.request_counts(s, [j.id for j in rows])
        data = [store.job_dict(j, counts[j.id]) for j in rows]
    if as_json:
        echo_json(data)
        return
    if not data:
        click.echo("no jobs yet; create one with `specbatch submit FILE` or `specbatch run FILE`")
        return
    from rich.table import Table

    table = Table(box=None)
    # an API batch's id beside its job's: the id an openai client holds (`status` takes either)
    batch = any(d["metadata"].get("batch_id") for d in data)
    for col in ("id", *(("batch",) if batch else ()), "status", "models", "done", "failed", "created"):
        table.add_column(col, no_wrap=col != "models")
    for d in data:
        c = d["request_counts"]
        table.add_row(d["id"], *((d["metadata"].get("batch_id") or "",) if batch else ()), d["status"], models(d),
                      f"{c['completed']}/{c['total']}", str(c["failed"]), when(d["created_at"]))
    _console().print(table)


# ---------------------------------------------------------------- status


def _check_workers(settings: Settings, queue: str) -> None:
    """On stderr: the job's workers that are starting or compiling, or that none consumes its queue."""
    check_queue_workers(settings, queue, "nothing will progress until one starts "
                        "(`specbatch worker` with this job's --target/--draft)", states=True)


def _status_view(d: dict[str, Any]) -> Any:
    """The job's status as one rich renderable (tables)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    st = d["stats"]
    info = Table(box=None, show_header=False, title=f"job {d['id']}", title_justify="left")
    info.add_column(style="bold")
    info.add_column()
    info.add_row("status", d["status"])
    info.add_row("models", models(d))
    for route in d.get("models", []):       # body.model -> the pair it runs on (unless it says no more)
        if route["model"] is not None and (route["model"], models(route)) != (d["target"], models(d)):
            info.add_row("", escape(f"{route['model']}: {models(route)} ({plural(route['requests'], 'request')})"))
    info.add_row("queue", d["queue"])
    if d["source"]:
        info.add_row("source", escape(d["source"]))
    for key in ("created_at", "started_at", "finished_at", "cancel_requested_at", "cancelled_at"):
        if d[key]:
            info.add_row(key.removesuffix("_at").replace("_", " "), when(d[key]))
    info.add_row("requests", counts_line(d["request_counts"]))
    for i, line in enumerate(failure_lines(d)):     # custom ids and errors are the user's text, not markup
        info.add_row("failures" if i == 0 else "", escape(line))
    if st["results"]:
        ar, mal, lat = st["acceptance_rate"], st["mean_acceptance_length"], st["latency_seconds"]
        info.add_row("acceptance rate", f"{num(ar['token_weighted'])} token-weighted, "
                                        f"{num(ar['request_mean'])} request mean")
        info.add_row("mean acceptance length", f"{num(mal['token_weighted'], '{:.2f}')} token-weighted, "
                                               f"{num(mal['request_mean'], '{:.2f}')} request mean")
        info.add_row("tokens generated", str(st["tokens_generated"]))
        if st.get("cache_hits"):
            info.add_row("cache hits", f"{plural(st['cache_hits'], 'result')} copied, "
                                       f"{plural(st['tokens_from_cache'], 'token')} not generated")
        pc = st.get("prefix_cache") or {}
        if pc.get("cached_prompt_tokens"):
            info.add_row("prefix cache", f"{plural(pc['cached_prompt_tokens'], 'prompt token')} read, not "
                                         f"prefilled ({num(pc['share'], '{:.0%}')} of prompt tokens, "
                                         f"{plural(pc['requests'], 'request')}; prefill seconds saved, summed over "
                                         f"requests: {pc['prefill_seconds_saved_sum']:.1f})")
        info.add_row("throughput", f"{num(st['tokens_per_second'], '{:.1f}')} tokens/s over "
                                   f"{st['wall_clock_seconds']:.1f} s wall clock")
        info.add_row("latency", f"p50 {num(lat['p50'], '{:.2f}')} s, p95 {num(lat['p95'], '{:.2f}')} s"
                                + (f" ({plural(lat['cache_hits'], 'cache hit')} not counted)"
                                   if lat.get("cache_hits") else ""))
        if st.get("grammar_drafted_tokens"):
            info.add_row("grammar drafting", f"{num(st['grammar_token_share'], '{:.0%}')} of the tokens were "
                                             f"forced by the grammar ({st['grammar_accepted_tokens']} of "
                                             f"{st['grammar_drafted_tokens']} drafted, accepted)")
        if st["pool_wins"]:
            info.add_row("pool wins", ", ".join(f"{k} {v}" for k, v in st["pool_wins"].items()))
        batching = st.get("batching") or {}
        if batching.get("batch_size_share"):
            info.add_row("batch sizes", batching_line(batching))
        if line := speculation_line(d):
            info.add_row("speculation", line)
    parts: list[Any] = [info]
    if st["workers"]:
        workers = Table(title="workers", title_justify="left", box=None)
        # results rows, not requests: a line with n samples is one request and n results
        for col in ("worker", "results", "tokens", "tokens/s", "busy tokens/s"):
            workers.add_column(col, justify="left" if col == "worker" else "right")
        for w in st["workers"]:
            workers.add_row(w["worker"], str(w["requests"]), str(w["tokens_generated"]),
                            num(w["tokens_per_second"], "{:.1f}"), num(w["busy_tokens_per_second"], "{:.1f}"))
        parts.append(workers)
    return Group(*parts)


def _refreshed_summary(settings: Settings, job_id: str) -> tuple[dict[str, Any], bool]:
    from specbatch.db.models import JobStatus
    from specbatch.jobs import store

    with open_db(settings).begin() as s:      # short write: counters and status from the rows
        job = store.refresh_job(s, job_id)
        jid, finished = job.id, JobStatus(job.status).finished
    with open_db(settings, readonly=True).begin() as s:
        return store.job_summary(s, jid), finished


def _pending_queues(settings: Settings, job_id: str) -> list[str]:
    """The queues the job's unfinished requests wait on (several with --model-map)."""
    from specbatch.jobs import store
    from specbatch.worker.queues import route_queue

    with open_db(settings, readonly=True).begin() as s:
        job = store.get_job(s, job_id)
        routes = store.request_routes(s, job.id, store.resumable_request_ids(s, job.id))
        return [route_queue(r, job.queue, job.drafts or []) for r in routes] or [job.queue]


def _say_how_a_run_ends(settings: Settings, job_id: str) -> None:
    """On stderr: who finishes a `specbatch run` job not finished. A run killed on this machine
    (SIGKILL, OOM) is named as gone, as a killed worker is: "if that run has stopped" left it open."""
    from specbatch.jobs import store
    from specbatch.worker.pids import gone_here

    with open_db(settings, readonly=True).begin() as s:
        dead = store.run_gone(s, store.get_job(s, job_id), gone_here)
    if dead:
        click.echo(f"job {job_id}'s `specbatch run` ({', '.join(dead)}) no longer runs on this machine: "
                   f"`specbatch run --resume {job_id}` finishes it", err=True)
        return
    click.echo(f"job {job_id} is run by `specbatch run`, not by workers; if that run has stopped, "
               f"`specbatch run --resume {job_id}` finishes it here", err=True)


def _warn_stranded(settings: Settings, job_id: str, queues: list[str]) -> None:
    """On stderr: how many of the job's requests nothing holds (running on an expired lease, or
    queued with no task in the broker) and that the live workers of their queues recover them."""
    from specbatch.jobs import store
    from specbatch.worker.pids import gone_here
    from specbatch.worker.stranded import without_task

    with open_db(settings, readonly=True).begin() as s:
        expired = store.expired_leases(s, job_id)
        # a worker killed on this machine (SIGKILL, OOM) holds its rows until the lease runs out
        held = store.held_by_gone(s, job_id, gone_here)
        try:
            lost = len(without_task(settings, s, queues, job_id))
        except Exception as e:      # the broker is down: the worker check above has said so
            logger.debug("stranded check: %s", e)
            lost = 0
    if held:
        n = sum(len(ids) for ids in held.values())
        warn(f"job {job_id}: {plural(n, 'running request')} held by "
             f"{'a worker' if len(held) == 1 else 'workers'} that no longer "
             f"{'runs' if len(held) == 1 else 'run'} on this machine ({', '.join(sorted(held))}): "
             f"nothing decodes them until the lease runs out (up to {settings.lease_seconds}s, "
             f"SPECBATCH_LEASE_SECONDS); `specbatch resume {job_id}` takes them back now")
    if not expired and not lost:
        return
    parts = ([f"{plural(expired, 'running request')} on an expired lease (its worker is gone)"] if expired else []) + \
        ([f"{plural(lost, 'queued request')} with no task in the broker (flushed or lost)"] if lost else [])
    sweep = settings.lease_sweep_seconds
    warn(f"job {job_id}: {plural(expired + lost, 'request')} stranded: {' and '.join(parts)}; being recovered: "
         f"a live worker of their queue queues them again within {sweep}s (queued ones: {2 * sweep}s; "
         f"SPECBATCH_LEASE_SWEEP_SECONDS); `specbatch resume {job_id}` does it now")


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("--watch", is_flag=True, help="Refresh until the job ends (Ctrl-C stops watching, not the job); piped: the final status "
                   "once it ends.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds between refreshes with --watch.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP + " With --watch: once the job ends.")
def status(job_id: str, watch: bool, interval: float, as_json: bool) -> None:
    """Show a job's status, request counts and speculative-decoding statistics.

    JOB is a job id (or a unique prefix of one, 4 characters or more) or an HTTP API batch's id.

    \b
    Example:
      specbatch status 3f9a2c
      specbatch status 3f9a2c --watch
      specbatch status 3f9a2c --json | jq .stats.acceptance_rate.token_weighted
    """
    import time

    from specbatch.jobs.store import run_in_its_process

    settings = get_settings()
    summary, finished = _refreshed_summary(settings, job_id)
    if not finished and run_in_its_process(summary["metadata"]):
        # no worker ever takes a `specbatch run` job: naming one (a worker of the same pair) misled
        _say_how_a_run_ends(settings, summary["id"])
    elif not finished:
        queues = _pending_queues(settings, summary["id"])
        for queue in queues:
            _check_workers(settings, queue)
        _warn_stranded(settings, summary["id"], queues)
    # machine output, or a pipe (where a live display is drawn only as it stops, without the final
    # newline): wait, then print the final summary once
    if watch and not finished and (as_json or not _console().is_terminal):
        while not finished:
            time.sleep(interval)
            summary, finished = _refreshed_summary(settings, summary["id"])
    elif watch and not finished:
        from rich.live import Live

        with Live(_status_view(summary), console=_console(), auto_refresh=False) as live:
            while not finished:
                time.sleep(interval)
                summary, finished = _refreshed_summary(settings, summary["id"])
                live.update(_status_view(summary), refresh=True)
        return
    if as_json:
        echo_json(summary)
    else:
        _console().print(_status_view(summary))


# ---------------------------------------------------------------- export


def _statuses(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    out = [x.strip() for v in value for x in v.split(",") if x.strip()]
    bad = [x for x in out if x not in REQUEST_STATUSES]
    if bad:
        raise click.BadParameter(f"{', '.join(bad)}: choose from {', '.join(REQUEST_STATUSES)}")
    return out


# -o's extension names the format, so `-o out.csv` never writes JSONL under a .csv name
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json-lines": "jsonl", ".csv": "csv", ".parquet": "parquet",
                    ".pq": "parquet"}


def _export_format(fmt: str | None, output: Path | None) -> str:
    """The format to write: -f if given (it must agree with a known extension of -o), else the one
    -o's extension names, else jsonl."""
    suffix = output.suffix.lower() if output is not None and str(output) != "-" else ""
    implied = FORMAT_BY_SUFFIX.get(suffix)
    if fmt is not None and implied is not None and fmt != implied:
        raise click.UsageError(f"-f {fmt} but {output} ends in {suffix}: drop -f or change the name")
    if fmt is None and implied is None and suffix:
        # `-o answers.xlsx` must not pass for a spreadsheet: say what the file will hold
        warn(f"{output}: {suffix} names no export format; writing jsonl (-f csv or -f parquet for those)")
    return fmt or implied or "jsonl"


def _unfinished_left_out(s: Any, job_id: str, fmt: str, statuses: list[str]) -> tuple[str, int, bool] | None:
    """(job status, count, stopped) of the pending and running requests the export left out, or
    None when it left none out: JSONL keeps finished requests by default, CSV and Parquet every
    request. ``stopped``: a `specbatch run` job that no process decodes (interrupted, or killed here)."""
    from specbatch.jobs import store
    from specbatch.jobs.openai_output import FINISHED
    from specbatch.worker.pids import gone_here

    kept = set(statuses) if statuses else set(FINISHED if fmt == "jsonl" else REQUEST_STATUSES)
    counts = store.request_counts(s, [job_id])[job_id]
    n = sum(counts[x] for x in ("pending", "running") if x not in kept)
    if not n:
        return None
    job = store.get_job(s, job_id)
    # job_dict's status, as `status` shows it: an interrupted `specbatch run` stays "running" in the table
    return store.job_dict(job)["status"], n, store.run_stopped(s, job, gone_here) is not None


def _warn_left_out(job_id: str, left_out: tuple[str, int, bool] | None) -> None:
    # a file exported while its job runs must not pass for the whole dataset
    if left_out is None:
        return
    job_status, n, stopped = left_out
    # no process ends a stopped run: `status --watch` would wait for ever
    ends = (f"`specbatch run --resume {job_id}` finishes them" if stopped
            else f"`specbatch status {job_id} --watch` waits for the job to end")
    warn(f"job {job_id} is {job_status}: {plural(n, 'request')} not finished yet {'is' if n == 1 else 'are'} "
         f"not in the file ({ends}; --status pending,running exports them as placeholders)")


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("-f", "--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="jsonl: OpenAI batch output lines; csv: one flat row per request; "
                   "parquet: typed columns for datasets / DuckDB / pandas. Default: the one -o's "
                   "extension names (.jsonl, .csv, .parquet or .pq), else jsonl.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="File to write ('-': stdout; missing directories are made). Default: stdout for "
                   "jsonl/csv, JOB.parquet for parquet.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, path_type=Path),
              help="jsonl: write failed/cancelled lines here and only successes to the output "
                   "(OpenAI's output/error file pair).")
@click.option("--status", "statuses", multiple=True, callback=_statuses, metavar="STATUS[,STATUS]",
              help=f"Only requests with these statuses ({', '.join(REQUEST_STATUSES)}); repeatable. "
                   "Default: jsonl, the finished ones; csv/parquet, all.")
@click.option("--force", is_flag=True, help="Overwrite existing files.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {id, format, path, rows[, errors_path, error_rows]} as JSON (file output).")
def export(job_id: str, fmt: str | None, output: Path | None, errors_path: Path | None, statuses: list[str],
           force: bool, as_json: bool) -> None:
    """Export a job's requests and results as JSONL, CSV or Parquet, in input order.

    JSONL lines have OpenAI's batch output shape; pending and running requests are left out
    unless --status asks for them. Parquet loads with pandas.read_parquet, DuckDB and
    datasets.load_dataset("parquet", data_files=...). Without -f the format is the one -o's
    extension names (.jsonl, .csv, .parquet), else jsonl. Files are written atomically and never
    overwritten without --force.

    \b
    Example:
      specbatch export 3f9a2c -o output.jsonl --errors errors.jsonl
      specbatch export 3f9a2c -o answers.parquet --status completed
      specbatch export 3f9a2c > answers.jsonl
    """
    from specbatch.jobs import export as exporter
    from specbatch.jobs import store

    fmt = _export_format(fmt, output)
    to_stdout = (output is None and fmt != "parquet") or str(output) == "-"
    if to_stdout and fmt == "parquet":
        raise click.UsageError("parquet is binary: give a file with -o PATH")
    if to_stdout and as_json:
        raise click.UsageError("--json reports on a written file: give one with -o PATH")
    if errors_path is not None and fmt != "jsonl":
        raise click.UsageError(f"--errors splits OpenAI batch lines: use it with jsonl output, not {fmt}")
    if errors_path is not None and output is not None and errors_path.resolve() == output.resolve():
        raise click.UsageError("--errors must name another file than -o")
    n_err = 0
    with open_db(get_settings(), readonly=True).begin() as s:
        jid = store.get_job(s, job_id).id
        out: Path | Any = click.get_text_stream("stdout") if to_stdout else (
            output if output is not None else Path(f"{jid}.parquet"))
        try:
            for p in (out, errors_path):
                if isinstance(p, Path):
                    p.parent.mkdir(parents=True, exist_ok=True)
            if fmt == "jsonl":
                n, n_err = exporter.write_openai(s, jid, out, errors_path, statuses=statuses, force=force)
            else:
                n = exporter.export_job(s, jid, fmt, out, statuses, force=force)
        except BrokenPipeError:
            raise   # the reader went away (`| head`): the CLI's edge exits quietly
        except OSError as e:
            raise click.ClickException(f"cannot write {e.filename or out}: {e.strerror or e}") from e
        left_out = _unfinished_left_out(s, jid, fmt, statuses)
    if to_stdout:
        if errors_path is not None:
            click.echo(f"wrote {plural(n_err, 'error line')} to {errors_path}", err=True)
        _warn_left_out(jid, left_out)
        return
    report: dict[str, Any] = {"id": jid, "format": fmt, "path": str(out), "rows": n}
    if errors_path is not None:
        report.update(errors_path=str(errors_path), error_rows=n_err)
    if as_json:
        echo_json(report)
    else:
        more = f" and {plural(n_err, 'error line')} to {errors_path}" if errors_path is not None else ""
        click.echo(f"wrote {plural(n, 'row')} to {out}{more}", err=True)
    _warn_left_out(jid, left_out)


# ---------------------------------------------------------------- cancel / retry


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def cancel(job_id: str, as_json: bool) -> None:
    """Cancel a job: pending requests are dropped, finished results are kept.

    Requests a worker is already generating are dropped at its next decoding step (the job is
    "cancelling" until then; a result stored before is kept). It waits up to 10 s for the workers
    and says how many of their requests were dropped and how many finished first. Requests of a
    worker killed on this machine are dropped at once; those of a worker lost elsewhere once their
    lease runs out (a live worker's lease sweep ends the job then).

    \b
    Example:
      specbatch cancel 3f9a2c
    """
    from specbatch.db.models import JobStatus
    from specbatch.jobs import store
    from specbatch.worker.pids import gone_here

    factory = open_db(get_settings())
    with factory.begin() as s:
        before = store.get_job(s, job_id)
        was = JobStatus(before.status)
        pending_before = store.request_counts(s, [before.id])[before.id]["pending"]
        job = store.cancel_job(s, before.id)
        # rows whose worker was killed on this machine would wait out their lease (minutes): dropped now
        orphans = store.drop_orphans(s, job.id, gone_here)
        summary = store.job_dict(job)
        held = store.running_ids(s, job.id)
    if as_json:
        echo_json(summary)
        return
    c = summary["request_counts"]
    if was.finished:
        click.echo(f"job {summary['id']} is already {was.value}; nothing to cancel")
        return
    gone = (f", {plural(len(orphans), 'running request')} of a worker that is no longer running dropped"
            if orphans else "")
    if not held:
        click.echo(f"job {summary['id']} cancelled: {plural(pending_before, 'pending request')} dropped{gone}, "
                   f"{plural(c['completed'], 'result')} kept")
        return
    # the workers see the cancel within a second (worker.cancel.CancelWatch) and drop their rows
    # at the next decoding step: wait a little, then say what became of the rows they held
    outcome = _await_held(factory, held)
    dropped, done, left = outcome.get("cancelled", 0), outcome.get("completed", 0) + outcome.get("failed", 0), \
        outcome.get("running", 0)
    line = f"{plural(dropped, 'running request')} dropped at the next decoding step, {done} finished first"
    if left:
        line += (f", {left} still running: dropped at their worker's next step (or once their lease runs out, "
                 "if that worker is gone); `specbatch status` shows the outcome")
    state = "is cancelling" if left else "cancelled"
    click.echo(f"job {summary['id']} {state}: {plural(pending_before, 'pending request')} dropped{gone}; {line}")


CANCEL_WAIT = 10.0      # seconds `cancel` waits for the workers to drop the rows they hold


def _await_held(factory: Any, held: list[int], wait: float = CANCEL_WAIT) -> dict[str, int]:
    """{status: count} of ``held`` once none is running, or when ``wait`` seconds have passed."""
    import time

    from specbatch.jobs import store

    deadline = time.monotonic() + wait
    while True:
        with factory.begin() as s:
            outcome = store.statuses_of(s, held)
        if not outcome.get("running") or time.monotonic() >= deadline:
            return outcome
        time.sleep(0.25)


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("--json", "as_json", is_flag=True,
              help=JSON_HELP + " For a job made by `specbatch run`: its summary, as `run --json`.")
def retry(job_id: str, as_json: bool) -> None:
    """Re-run a job's failed requests (only those; finished results are never redone).

    A job made by `specbatch run` is re-run in this process, as `specbatch resume` does (no broker
    or worker needed); the exit status is then run's (3: some requests failed again).

    \b
    Example:
      specbatch retry 3f9a2c
    """
    from specbatch.jobs import store
    from specbatch.worker.submission import read_database_id

    settings = get_settings()
    factory = open_db(settings)
    read_database_id(settings)
    with factory.begin() as s:
        ids = store.retry_failed(s, job_id)
        job = store.get_job(s, job_id)
        jid, queue, job_drafters = job.id, job.queue, list(job.drafts or [])
        embedded = store.run_in_its_process(job.meta)
        routes = store.request_routes(s, jid, ids, by_prefix=True)
    if ids and embedded:
        # no worker consumes a `run` job's queue: the rows are pending again, and run's
        # in-process path (as `run --resume`) finishes them here
        from specbatch.cli.queue import run_in_process

        if not as_json:
            click.echo(f"job {jid}: {plural(len(ids), 'failed request')} pending again; running "
                       f"{'it' if len(ids) == 1 else 'them'} here (a job made by `specbatch run`)", err=True)
        run_in_process(jid, as_json)
        return
    report: dict[str, Any] = {"id": jid, "retried": len(ids), "request_ids": ids, "queue": queue, "tasks": 0}
    if ids:
        # the rows are committed as pending first: whatever happens to the broker, `resume` finishes them
        later = f"they are pending again; run `specbatch resume {jid}` once the queue is up"
        from specbatch.worker.enqueue import enqueue_routes

        try:
            report["tasks"] = sum(enqueue_routes(settings, jid, routes, queue, job_drafters).values())
        except BrokerUnavailable as e:
            raise click.ClickException(f"the broker is unreachable ({e}): {plural(len(ids), 'failed request')} "
                                       f"of job {jid} {'was' if len(ids) == 1 else 'were'} not queued; "
                                       f"{later}") from e
    if as_json:
        echo_json(report)
    elif ids:
        click.echo(f"job {jid}: {plural(len(ids), 'failed request')} queued again on {queue}")
    else:
        click.echo(f"job {jid} has no failed requests; nothing to retry")


# ---------------------------------------------------------------- db


@click.group()
def db() -> None:
    """Database maintenance: migrations and where the database is.

    \b
    Example:
      specbatch db upgrade
      SPECBATCH_DATABASE_URL=postgresql+psycopg://user@host/specbatch specbatch db upgrade
    """


@db.command("upgrade")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def db_upgrade(as_json: bool) -> None:
    """Migrate the database to the newest schema (creates a new SQLite file if needed).

    \b
    Example:
      specbatch db upgrade
    """
    from sqlalchemy.exc import OperationalError

    from specbatch import db as store_db

    url = get_settings().database_url
    shown = shown_url(url)
    path = store_db.sqlite_path(url)
    is_new = path is not None and not path.exists()
    try:
        # (not read from a SQLite file that is not there: connecting would create it)
        before = None if is_new else store_db.current_revision(url)
        store_db.upgrade(url)
        revision = store_db.current_revision(url)
    except OperationalError as e:
        raise database_error("migrate", shown, e) from e
    if is_new:
        click.echo(f"specbatch: created a new database at {path}", err=True)
    if as_json:
        echo_json({"url": shown, "revision": revision, "previous": before})
    elif before == revision:
        click.echo(f"database {shown} is at revision {revision} already (the newest): nothing to migrate")
    else:
        click.echo(f"database {shown} migrated from {before or 'an empty schema'} to revision {revision}")


@db.command("url")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def db_url(as_json: bool) -> None:
    """Print the database URL in use (password hidden).

    \b
    Example:
      sqlite3 "$(specbatch db url | sed 's|sqlite:///||')" 'select * from specbatch_results limit 5'
    """
    from specbatch.db import sqlite_path

    url = get_settings().database_url
    shown = shown_url(url)
    path = sqlite_path(url)
    if as_json:
        echo_json({"url": shown, "path": str(path) if path else None,
                   "exists": path.exists() if path else None})
    else:
        click.echo(shown)
