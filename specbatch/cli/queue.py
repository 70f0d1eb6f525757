"""Queue commands: submit, run, worker, resume, flower."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specbatch.cli.common import (
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    check_pair_device,
    check_queue_workers,
    compile_option,
    loading_models,
    nonempty_stops,
    open_db,
    warn,
)
from specbatch.cli.compile_text import compiling_notice, report_compile, use_compile_cache
from specbatch.cli.json_out import echo_json
from specbatch.cli.throughput import device_options, no_draft, resolve_throughput, throughput_options
from specbatch.config import Settings, get_settings
from specbatch.errors import OUT_OF_MEMORY_ADVICE, SpecBatchError, one_line, out_of_memory
from specbatch.plural import plural
from specbatch.redact import mask

if TYPE_CHECKING:
    from specbatch.engine.engine import Engine
    from specbatch.worker.local import LocalJob


def model_options(f: Any) -> Any:
    """--target / --draft / --ngram (no model option at all: the default pair from settings)."""
    f = click.option("--ngram", is_flag=True, help="Add the prompt-lookup (n-gram) drafter to the pool (--draft ngram names it, "
                                                                   "in place of the default draft).")(f)
    f = click.option("--draft", "drafts", multiple=True, metavar="DRAFTER",
                     help="Drafter: a draft model (name, directory, .gguf file, HF id, or model:NAME) or "
                          "ngram; repeat for a pool.")(f)
    f = click.option("--target", metavar="MODEL",
                     help="Target model: known name, directory, .gguf file or HF id.")(f)
    return f


def sampling_options(f: Any) -> Any:
    """Job-wide defaults for lines that do not set them (same names as `specbatch generate`)."""
    f = click.option("--stop", multiple=True, metavar="TEXT", callback=nonempty_stops,
                     help="Default stop string (repeatable); the text ends before it.")(f)
    for name, kind, help_ in (
        ("--seed", SEED, "Default seed."),
        ("--top-k", TOP_K, "Default top-k (0: off)."),
        ("--top-p", TOP_P, "Default top-p."),
        ("--temperature", TEMPERATURE, "Default temperature (0: greedy)."),
    ):
        f = click.option(name, type=kind, default=None, help=help_)(f)
    f = click.option("--max-new-tokens", "--max-tokens", "max_new_tokens", type=click.IntRange(min=1), default=None,
                     help="Default max new tokens per request (alias --max-tokens).")(f)
    return f


def resolve_pair(settings: Settings, target: str | None, drafts: tuple[str, ...], ngram: bool = False
                 ) -> tuple[str, list[str]]:
    """The target and pool the options name (the default pair without any; ``ngram``: --ngram,
    the n-gram drafter added to it), the pool as drafter spec strings (``Pair.drafts``); a name
    that is no model here (``known_models.name_problem``) is refused (ModelLoadError)."""
    from specbatch.worker.submission import Pair

    added = ["ngram"] if ngram else []
    if [d.lower() for d in drafts] == ["none"]:     # --draft none / --no-speculation: the target alone
        drafts = ()
        target = target or settings.default_target
    pair = Pair.resolve(settings, target, drafts, added)
    return pair.target, pair.drafts


def _defaults(max_new_tokens: int | None, temperature: float | None, top_p: float | None,
              top_k: int | None, seed: int | None, stop: tuple[str, ...] = ()) -> dict[str, Any]:
    d = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
         "seed": seed, "stop": list(stop) or None}
    return {k: v for k, v in d.items() if v is not None}


def model_map_option(f: Any) -> Any:
    return click.option(
        "--model-map", "model_map", multiple=True, metavar="NAME=TARGET[,DRAFT...]",
        help="Route OpenAI lines whose body.model is NAME to this target (and drafts; repeatable). "
             "Lines without body.model use --target/--draft.")(f)


def _read_file(settings: Settings, file: str, defaults: dict[str, Any], model_map: tuple[str, ...],
               pair: tuple[str, list[str]] | None = None) -> Any:
    """The validated file ('-': standard input) with its warnings (intake.ParsedFile); with the
    job's ``pair`` (target, drafts), a prompt too long for its pair's context is refused too, and
    a logit_bias key outside a local target's vocabulary, each listed with the file's other errors."""
    from specbatch.jobs import intake
    from specbatch.jobs.context import ContextCheck

    routes = intake.parse_model_map(model_map, allow_remote=settings.allow_remote_models)
    budget = "--max-new-tokens" if "max_new_tokens" in defaults else "max_new_tokens"
    limits = ContextCheck(settings, *pair, default_budget=budget) if pair is not None else None
    vocab_of = intake.vocab_lookup(settings.cache_dir, pair[0]) if pair is not None else None
    if file == "-":
        return intake.read_stream(click.get_binary_stream("stdin"), "<stdin>", defaults, settings, routes,
                                  limits, vocab_of)
    return intake.read_file(file, defaults, settings, routes, limits, vocab_of)


def cache_option(f: Any) -> Any:
    return click.option("--no-cache", "no_cache", is_flag=True,
                        help="Generate every request, even those the results cache holds "
                             "(the new results still fill it).")(f)


def _create_job(settings: Settings, file: str, target: str, drafts: list[str],
                defaults: dict[str, Any], queue: str, model_map: tuple[str, ...] = (), *,
                parsed: Any = None, metadata: dict[str, Any] | None = None, cache: bool = True
                ) -> tuple[str, dict[Any, list[int]]]:
    """Validate (unless ``parsed`` already is) and store the file as a job; returns its id and its
    pending request ids per pair."""
    from specbatch.engine.drafter_specs import parse_drafters
    from specbatch.jobs import store
    from specbatch.worker.submission import Pair, read_database_id, store_job

    if parsed is None:
        parsed = _read_file(settings, file, defaults, model_map, (target, drafts))
        for line in parsed.warnings(target):
            warn(line)
    pair = Pair(target, parse_drafters(drafts))
    assert pair.queue == queue, (pair.queue, queue)
    factory = open_db(settings, create=True)
    if not store.run_in_its_process(metadata):
        read_database_id(settings)
    with factory.begin() as s:
        return store_job(s, parsed, pair=pair, defaults=defaults,
                         source="<stdin>" if file == "-" else str(Path(file).resolve()), metadata=metadata,
                         cache=cache)


def _warn_no_consumer(settings: Settings, queue: str) -> None:
    check_queue_workers(settings, queue, "start one with `specbatch worker` and the same --target/--draft options")


def wait_for_job(settings: Settings, job_id: str, interval: float = 1.0) -> dict[str, Any]:
    """A progress bar on stderr until the job ends; returns its summary. Ctrl-C stops waiting (exit
    130), not the job."""
    from specbatch.jobs import store

    factory = open_db(settings)
    try:
        _progress_until_finished(factory, job_id, interval)
    except KeyboardInterrupt:
        click.echo(f"stopped waiting; job {job_id} goes on (`specbatch status {job_id} --watch`)", err=True)
        sys.exit(130)
    with factory.begin() as s:
        return store.job_summary(s, job_id)


def _progress_until_finished(factory: Any, job_id: str, interval: float) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specbatch.jobs import store

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=Console(stderr=True)) as progress:
        task = progress.add_task(f"job {job_id}", total=None, detail="")
        while True:
            with factory.begin() as s:        # short write: counters and status from the rows
                job = store.refresh_job(s, job_id)
                c = {n: getattr(job, n) for n in store.COUNT_NAMES}
                status = job.status
            done = c["completed"] + c["failed"] + c["cancelled"]
            detail = f"{status.value}  failed {c['failed']}" if c["failed"] else status.value
            progress.update(task, total=c["total"], completed=done, detail=detail)
            if status.finished:
                break
            time.sleep(interval)


def exit_by_outcome(summary: dict[str, Any]) -> None:
    """Exit 0 when every request completed, else 1 with one line saying what happened."""
    if summary["status"] != "completed":
        c = summary["request_counts"]
        raise click.ClickException(
            f"job {summary['id']} ended {summary['status']}: {c['completed']} completed, {c['failed']} failed, "
            f"{c['cancelled']} cancelled; `specbatch export {summary['id']} --errors errors.jsonl` lists them")


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@model_options
@model_map_option
@sampling_options
@click.option("--wait", is_flag=True, help="Show a progress bar until the job ends; exit 0 only if every "
                                           "request completed.")
@click.option("--fallback-draft", is_flag=True,
              help="LOSSY: where the target keeps failing, generate with the draft alone; such "
                   "results are flagged lossy in the database and every export. Off by default.")
@cache_option
@click.option("--allow-remote-models", is_flag=True,
              help="Take model names this machine cannot check: paths that only the workers hold "
                   "(default: a name must be known, a model path here, or a Hugging Face org/name id; "
                   "SPECBATCH_ALLOW_REMOTE_MODELS=1 does the same).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the new job as JSON (id, status, request_counts, queue, tasks, ...).")
def submit(file: str, target: str | None, drafts: tuple[str, ...], ngram: bool, model_map: tuple[str, ...],
           max_new_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
           seed: int | None, stop: tuple[str, ...], wait: bool, fallback_draft: bool, no_cache: bool,
           allow_remote_models: bool, as_json: bool) -> None:
    """Validate a JSONL prompt file ('-': standard input), store it as a job and queue it for the workers.

    Needs the broker (SPECBATCH_BROKER_URL) and a `specbatch worker` started with the same
    --target/--draft/--ngram options; prints the job id.

    \b
    Example:
      specbatch submit examples/prompts.jsonl --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
      specbatch submit batch.jsonl --model-map gpt-4o-mini=qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --wait
      cat prompts.jsonl | specbatch submit - --max-new-tokens 256 --temperature 0.7 --seed 1 --json
    """
    from specbatch.engine.drafter_specs import model_names, parse_drafters
    from specbatch.jobs import store
    from specbatch.observability import tracing
    from specbatch.worker.enqueue import check_broker, enqueue_routes
    from specbatch.worker.queues import queue_name

    settings = get_settings()
    if allow_remote_models:
        settings = settings.model_copy(update={"allow_remote_models": True})
    target_, drafts_ = resolve_pair(settings, target, drafts, ngram)
    queue = queue_name(target_, drafts_)
    if fallback_draft and not model_names(parse_drafters(drafts_)):
        raise click.UsageError("--fallback-draft needs a --draft model to fall back to")
    defaults = _defaults(max_new_tokens, temperature, top_p, top_k, seed, stop)
    # the file first: local, a local model's logit_bias keys too (others by the worker, per request)
    parsed = _read_file(settings, file, defaults, model_map, (target_, drafts_))
    check_broker(settings)  # broker down: fail before anything is written
    for line in parsed.warnings(target_) + _weights_elsewhere(target_, drafts_, parsed.model_map):
        warn(line)
    tracing.configure("specbatch")   # one trace per job when OTEL_* asks for it
    with tracing.span("submit", {"specbatch.queue": queue, "specbatch.file": file}):
        with tracing.span("intake"):
            job_id, routes = _create_job(settings, file, target_, drafts_, defaults, queue, model_map,
                                         parsed=parsed,
                                         metadata={"fallback_draft": True} if fallback_draft else None,
                                         cache=not no_cache)
        tracing.set_attributes({"specbatch.job.id": job_id})
        sent = enqueue_routes(settings, job_id, routes, queue, drafts_)
    n, tasks = sum(len(v) for v in routes.values()), sum(sent.values())
    queues = ", ".join(sent) or queue
    if not as_json:
        click.echo(f"job {job_id}: {plural(n, 'request')} in {plural(tasks, 'task')} on queue {queues}")
    for q in sent:
        _warn_no_consumer(settings, q)
    if wait:
        summary = wait_for_job(settings, job_id)
    elif as_json:
        with open_db(settings, readonly=True).begin() as s:
            summary = store.job_summary(s, job_id)
    if as_json:
        echo_json({**summary, "job_id": job_id, "requests": n, "tasks": tasks, "queues": sent})
    if wait:
        exit_by_outcome(summary)


def _weights_elsewhere(target: str, drafts: list[str], model_map: dict[str, Any] | None) -> list[str]:
    """A warning per known model of the job whose weights are not installed here. Not a refusal:
    `submit` reads no weights (a model with no files here is left to its worker: jobs/context.py),
    and the workers may run on machines that have them; a worker here would not start."""
    from specbatch.engine.drafter_specs import model_names, parse_drafters
    from specbatch.engine.known_models import missing_weights

    pairs = [(target, drafts), *(model_map or {}).values()]
    names = dict.fromkeys(n for t, ds in pairs for n in (t, *model_names(parse_drafters(ds))))
    return [f"{hint} (where the workers run; the job is queued: a worker that cannot load it does not start)"
            for hint in map(missing_weights, names) if hint is not None]


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("--in-process", is_flag=True,
              help="Finish the job here (like `specbatch run --resume`), without broker or worker.")
@click.option("--json", "as_json", is_flag=True, help="Print what was re-enqueued as JSON.")
def resume(job_id: str, in_process: bool, as_json: bool) -> None:
    """Re-enqueue a job's pending and lease-expired requests now.

    Use it after a broker flush or restart, or when a worker died holding requests; a request that
    already has a result is never generated again. Requests still leased by a worker are queued
    too: they run once their lease ends, if that worker does not finish them first; those of a
    worker that ran on this machine and has exited (killed) are claimable at once.
    A job made by `specbatch run` is finished in this process (no broker needed), as with
    --in-process. JOB is a job id (or a unique prefix of one, 4 characters or more) or an HTTP API batch's id.

    \b
    Example:
      specbatch resume 3f9a2c
    """
    from specbatch.jobs import store
    from specbatch.observability import tracing
    from specbatch.worker.embedded_names import release_dead_embedded
    from specbatch.worker.enqueue import enqueue_routes
    from specbatch.worker.pids import gone_here

    settings = get_settings()
    factory = open_db(settings)
    with factory.begin() as s:
        job = store.get_job(s, job_id)
        job_id, queue, job_drafters = job.id, job.queue, list(job.drafts or [])
        job_status, stopping = job.status.value, job.status in store.STOPPING_JOB
        embedded = store.run_in_its_process(job.meta)
        released = release_dead_embedded(s, job_id)
        # a worker killed on this machine holds its rows until its lease runs out (minutes): as
        # `cancel` does, its rows are claimable now (the same check: worker.pids.gone_here)
        gone = {} if embedded else store.expire_gone_leases(s, job_id, gone_here)
        leased = store.leased_requests(s, job_id)
        ids = sorted(set(store.resumable_request_ids(s, job_id)) | {rid for rid, _, _ in leased})
        routes = store.request_routes(s, job_id, ids, by_prefix=True)
    if in_process or embedded:
        run_in_process(job_id, as_json)
        return
    if stopping:        # as `retry`: a cancelled job's requests are dropped for good
        raise SpecBatchError(f"job {job_id} is {job_status}; a cancelled job cannot be resumed "
                             "(submit the file again)")
    if not ids and not as_json:     # say so, rather than "re-enqueued 0 requests" after a worker check
        click.echo(f"job {job_id} is {job_status}; nothing to resume")
        return
    tracing.configure("specbatch")
    with tracing.span("resume", {"specbatch.job.id": job_id}):
        sent = enqueue_routes(settings, job_id, routes, queue, job_drafters)
    n, tasks = sum(len(v) for v in routes.values()), sum(sent.values())
    until = max((t for _, _, t in leased), default=None)
    if as_json:
        echo_json({"job_id": job_id, "queue": queue, "queues": sent, "requests": n, "tasks": tasks,
                   "leased": len(leased), "released": len(released) + sum(len(v) for v in gone.values()),
                   "leased_until": until.isoformat() if until else None})
    else:
        click.echo(f"job {job_id}: re-enqueued {plural(n, 'request')} in {plural(tasks, 'task')} on queue "
                   f"{', '.join(sent) or queue}")
        for holder, rids in sorted(gone.items()):
            click.echo(f"{len(rids)} of them {'was' if len(rids) == 1 else 'were'} held by {holder}, which no "
                       "longer runs on this machine: claimable now")
        if leased and until is not None:
            wait = max(0.0, (until - datetime.now(timezone.utc)).total_seconds())
            workers = sorted({w for _, w, _ in leased})
            click.echo(f"{len(leased)} of them {'is' if len(leased) == 1 else 'are'} still leased by {', '.join(workers)}: claimable from "
                       f"{until:%H:%M:%S} UTC (in {wait:.0f}s) unless that worker finishes them first")
    for q in sent:
        _warn_no_consumer(settings, q)


@click.command()
@model_options
@device_options
@throughput_options
@compile_option
@click.option("--hostname", "-n", default=None, help="Worker node name (default specbatch-PID@host).")
@click.option("--loglevel", "-l", default="INFO", show_default=True,
              help="Celery log level (DEBUG, INFO, WARNING, ERROR).")
@click.option("--pool", type=click.Choice(["prefork", "solo"]), default="prefork", hidden=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics on this port (default: SPECBATCH_METRICS_PORT; 0: off).")
def worker(target: str | None, drafts: tuple[str, ...], ngram: bool, device: str | None, dtype: str | None,
           batch_size: int | str | None, max_memory: int | None, threads: int | None, no_prefix_cache: bool,
           no_speculation: bool, compile_: str | None, hostname: str | None, loglevel: str, pool: str,
           metrics_port: int | None) -> None:
    """Run a Celery worker that holds one model pair and consumes that pair's queue.

    Both models load before the worker consumes (it is online meanwhile: `status` names it);
    compiling then runs in the background while it decodes eagerly. Start one worker per GPU.

    \b
    Example:
      specbatch worker --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --device cuda:0 -n gpu0@%h
      specbatch worker                     # the default pair on the CPU
      specbatch worker --metrics-port 9400 # Prometheus scrapes http://HOST:9400/metrics
    """
    from specbatch.errors import ModelLoadError
    from specbatch.worker.enqueue import wait_for_broker
    from specbatch.worker.runner import check_unique_name, default_hostname, run_worker, stop_on_sigterm

    stop_on_sigterm()      # from here a SIGTERM exits 0 (the broker wait below can last a minute)
    settings = get_settings()
    tp = resolve_throughput(settings, batch_size, max_memory, threads, no_prefix_cache)
    plain = no_draft(drafts, no_speculation)
    try:   # refused now, not after Celery's banner and a pool child's load, each saying it again
        target_, drafts_ = resolve_pair(settings, target, ("none",) if plain else drafts, ngram and not plain)
    except ModelLoadError as e:
        raise ModelLoadError(f"worker not started, cannot load models: {e}") from None
    check_pair_device(target_, drafts_, device or settings.device)
    check_unique_name(settings, hostname or default_hostname())
    # before the models load and Celery starts: its own start-up retries fill minutes with lines
    wait_for_broker(settings, warn)
    code, load_error = run_worker(settings, target=target_, drafts=drafts_,
                                  device=device, dtype=dtype,    # (None: run_worker reads the settings)
                                  batch_size=tp.batch_size, max_memory=tp.max_memory, threads=tp.threads,
                                  prefix_cache=tp.prefix_cache, compile=compile_,
                                  hostname=hostname,
                                  loglevel=loglevel, pool=pool,
                                  metrics_port=settings.metrics_port if metrics_port is None else metrics_port)
    if load_error:
        raise ModelLoadError(f"worker not started, cannot load models: {load_error}")
    sys.exit(code)


@click.command()
@click.option("--port", type=int, default=None, help="Port (default: settings, 5555).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to bind; any non-loopback address needs SPECBATCH_FLOWER_PASSWORD (or Flower's basic auth).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower(port: int | None, address: str, flower_args: tuple[str, ...]) -> None:
    """Start Flower on our broker (basic auth when SPECBATCH_FLOWER_PASSWORD is set; an address
    other than loopback needs it, as `serve` needs keys).

    Extra arguments after `--` go to Flower as they are.

    \b
    Example:
      SPECBATCH_FLOWER_PASSWORD=s3cret specbatch flower --port 5555 --address 0.0.0.0
    """
    from specbatch.cli.serve import bind, is_loopback

    settings = get_settings()
    port = port or settings.flower_port
    # as `serve` refuses a non-loopback bind without keys: Flower's pages can revoke tasks and
    # shut workers down. Flower's own auth (FLOWER_BASIC_AUTH, --basic-auth=, --auth=) counts too.
    own_auth = os.environ.get("FLOWER_BASIC_AUTH") or any(
        a.startswith(("--basic-auth", "--basic_auth", "--auth")) for a in flower_args)
    if not settings.flower_password and not own_auth and not is_loopback(address):
        raise click.UsageError(f"refusing to run Flower on {address} without a password: set "
                               "SPECBATCH_FLOWER_PASSWORD or bind 127.0.0.1")
    # a busy port is one line, as for `serve` (Flower itself ends in a 38-line traceback); the probe
    # socket is closed before Flower binds (it takes no socket from us)
    bind(address, port).close()
    env = dict(os.environ)
    if settings.flower_password:
        env["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{settings.flower_password}"
    elif not own_auth:
        warn("no SPECBATCH_FLOWER_PASSWORD: Flower runs without authentication (on this machine only)")
    argv = [sys.executable, "-m", "celery", "-A", "specbatch.worker.flower", "flower",
            f"--port={port}", f"--address={address}", *flower_args]
    os.execve(sys.executable, argv, env)


# `specbatch run` exit statuses (README "Exit status"): 0 every request completed; 1 the job
# failed (no request completed) or an error; 2 usage or settings error; 3 the job completed with
# some requests failed (partial results); 130 interrupted (Ctrl-C), resumable.
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, allow_dash=True), required=False)
@model_options
@model_map_option
@sampling_options
@device_options
@throughput_options
@compile_option
@click.option("--resume", "resume_job", metavar="JOB", default=None,
              help="Finish an interrupted (or stranded) job in this process instead of reading FILE.")
@cache_option
@click.option("--processes", type=click.IntRange(min=1), default=None,
              help="On a CPU, processes that decode the job after the models load once, sharing their "
                   "weights; the cores are divided among them [SPECBATCH_PROCESSES, default 1].")
@click.option("--json", "as_json", is_flag=True, help="Print the finished job's summary as JSON.")
def run(file: str | None, target: str | None, drafts: tuple[str, ...], ngram: bool, model_map: tuple[str, ...],
        max_new_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
        seed: int | None, stop: tuple[str, ...], device: str | None, dtype: str | None,
        batch_size: int | str | None, max_memory: int | None, threads: int | None, no_prefix_cache: bool,
        no_speculation: bool, compile_: str | None, resume_job: str | None, no_cache: bool,
        processes: int | None, as_json: bool) -> None:
    """Submit, generate and summarise a prompt file ('-': standard input) in this process (no Redis).

    With no model option it uses the default pair (see `specbatch models`). Results go to the
    database (SPECBATCH_DATABASE_URL); `specbatch export JOB -o FILE` writes them to a file.

    Ctrl-C stops at the next decoding step, keeps every finished result and marks the job
    interrupted; `specbatch run --resume JOB` finishes it. A second Ctrl-C exits at once.
    Exit status: 0 all completed, 1 the job failed or an error, 2 usage or settings error,
    3 some requests failed, 130 interrupted.

    \b
    Example:
      specbatch run examples/prompts.jsonl
      specbatch run prompts.jsonl --target DIR --draft DIR2 --ngram --max-new-tokens 64 --json
      specbatch run batch.jsonl --model-map gpt-4o-mini=DIR,DIR2 --model-map gpt-4o=DIR3
      cat prompts.jsonl | specbatch run -
      specbatch run --resume 3f9a2c
    """
    from specbatch.engine.threads import configure_threads
    from specbatch.jobs import intake, store
    from specbatch.observability import tracing
    from specbatch.worker.local import LoadOptions, LocalJob
    from specbatch.worker.queues import queue_name

    settings = get_settings()
    if no_draft(drafts, no_speculation):
        drafts, ngram = ("none",), False
    resumed = None
    if resume_job is not None:
        if file is not None:
            raise click.UsageError("give FILE or --resume JOB, not both")
        if target is not None or drafts or model_map:
            raise click.UsageError("a resumed job runs on its own models; drop --target/--draft/--model-map")
        # the job before torch (configure_threads, the engine): a mistyped id is one line at once
        resumed = _resumable(settings, resume_job)
    elif file is None:
        raise click.UsageError("missing FILE (or --resume JOB)")
    tp = resolve_throughput(settings, batch_size, max_memory, threads, no_prefix_cache)
    if resumed is not None and not resumed.routes:    # nothing to generate: nothing to set up
        _report(settings, resumed.job_id, True, as_json)
        return
    processes = _processes(settings, processes or settings.processes, device, compile_)
    configure_threads(tp.threads, settings.local_workers, settings.lanes, processes)
    tracing.configure("specbatch")   # a trace of the run when OTEL_* asks for it
    options = LoadOptions(device or settings.device, dtype or settings.dtype, tp.batch_size,
                          compile_ or settings.compile, tp.max_memory, tp.prefix_cache, processes)
    if resumed is not None:
        _run_here(settings, resumed, options, as_json, asked=compile_ is not None)
        return
    assert file is not None
    target_, drafts_ = resolve_pair(settings, target, drafts, ngram)
    check_pair_device(target_, drafts_, options.device)
    defaults = _defaults(max_new_tokens, temperature, top_p, top_k, seed, stop)
    # a bad file: nothing loaded or written
    parsed = _read_file(settings, file, defaults, model_map, (target_, drafts_))
    for line in parsed.warnings(target_):
        warn(line)
    _say_stopped_runs(settings, file)
    # the models before the job: a pair that cannot load leaves no job behind (a --model-map
    # route that cannot load later fails its own requests, with the reason)
    try:
        engine = _load_shown(settings, options, asked=compile_ is not None)(target_, drafts_,
                                                [int(r.params.get("max_new_tokens") or 0) for r in parsed.requests])
    except KeyboardInterrupt:   # Ctrl-C while loading: 130 as for any interrupted run (not click's "Aborted!", 1)
        click.echo("interrupted while loading the models; no job was made", err=True)
        sys.exit(EXIT_INTERRUPTED)
    # logit_bias keys against the loaded target's vocabulary: still nothing written
    vocab = engine.target.vocab_size
    # (for a target whose files told no size at intake, a GGUF not yet read, say)
    local = intake.vocab_lookup(settings.cache_dir, target_)
    intake.check_token_ids(parsed, "<stdin>" if file == "-" else file,
                           lambda t: vocab if t in (None, target_) else local(t))
    job_id, routes = _create_job(settings, file, target_, drafts_, defaults, queue_name(target_, drafts_),
                                 model_map, parsed=parsed, metadata={store.EMBEDDED: True}, cache=not no_cache)
    held = [engine]
    del engine     # (the list is the only name for it: run_job lets go of it before a next pair loads)
    _run_here(settings, LocalJob(job_id, target_, drafts_, routes), options, as_json, held,
              asked=compile_ is not None)


def _say_stopped_runs(settings: Settings, file: str) -> None:
    """Before a `run FILE` loads its models: the file's earlier run jobs that stopped unfinished
    (Ctrl-C, a kill). Starting the same command again made a new job and said nothing of the old
    one, left `interrupted` for ever (qa51); resuming it is the user's choice (the file may have
    changed since), so it is named, not resumed."""
    from sqlalchemy.exc import SQLAlchemyError

    from specbatch.db import sqlite_path
    from specbatch.jobs import store
    from specbatch.worker.pids import gone_here

    path = sqlite_path(settings.database_url)
    if file == "-" or (path is not None and not path.exists()):
        return
    try:
        with open_db(settings, readonly=True).begin() as s:
            stopped = store.stopped_runs(s, str(Path(file).resolve()), gone_here)
    except SQLAlchemyError:     # (a database not migrated yet: the job's creation says what is wrong)
        return
    for job_id, left, how in stopped:
        click.echo(f"specbatch: an earlier run of this file, job {job_id}, was {how} with "
                   f"{plural(left, 'request')} left; `specbatch run --resume {job_id}` finishes it (this run "
                   "starts a new job)", err=True)


def run_in_process(job_id: str, as_json: bool) -> None:
    """Finish an existing job in this process with run's default options, as `run --resume JOB`
    does (resume --in-process, resume and retry of a job made by run)."""
    from specbatch.engine.threads import configure_threads
    from specbatch.observability import tracing
    from specbatch.worker.local import LoadOptions

    settings = get_settings()
    tp = resolve_throughput(settings, None, None, None, False)
    processes = _processes(settings, settings.processes, None, None)
    configure_threads(tp.threads, settings.local_workers, settings.lanes, processes)
    tracing.configure("specbatch")
    _run_here(settings, job_id, LoadOptions(settings.device, settings.dtype, tp.batch_size, settings.compile,
                                            tp.max_memory, tp.prefix_cache, processes), as_json)


def _processes(settings: Settings, processes: int, device: str | None, compile_: str | None) -> int:
    """The processes `run` decodes in: one, with a warning, where the options cannot fork."""
    from specbatch.worker.forked import cannot_fork

    if processes > 1 and (why := cannot_fork(device or settings.device, compile_ or settings.compile,
                                             settings.lanes, settings.database_url)):
        warn(f"decoding in one process, not {processes}: {why}")
        return 1
    return processes


def _run_here(settings: Settings, job: Any, options: Any, as_json: bool, held: list[Engine] | None = None,
              asked: bool = False) -> None:
    """Generate ``job`` (a LocalJob, or the id of one to resume) here, print its summary and exit
    with run's status (README "Exit status"). ``held``: the job's first pair, already loaded, in a
    list this takes it out of (a caller's name for it would keep its memory while the next
    ``--model-map`` pair loads). ``asked``: --compile was given (``_load_shown``)."""
    from rich.console import Console

    from specbatch.worker.interrupt import stop_on_signals
    from specbatch.worker.local import RunHooks, run_job

    if isinstance(job, str):
        job = _resumable(settings, job)
    job_id = job.job_id
    console = Console(stderr=True)

    def on_first() -> None:
        console.print("[yellow]stopping at the next step (Ctrl-C again to exit at once)...[/]")

    # each pair's thread-governor line (engine/contention.py), read when it is done: run_job lets
    # go of a pair's engine before it loads the next (its memory first), so none is kept here;
    # the pair loaded before the job (`run FILE`) is handed out by the load hook, never passed as
    # an argument (a caller's frame can hold its arguments for the call's length: under a tracer,
    # CPython does)
    lines: list[str] = []
    current: Engine | None = None
    load = _load_shown(settings, options, console, asked)

    def done() -> None:
        nonlocal current
        if current is not None and (line := current.contention_line()):
            lines.append(line)
        current = None

    def loaded(target: str, drafts: list[str], budgets: list[int]) -> Engine:
        nonlocal current
        done()
        own_pair = (target, list(drafts)) == (job.target, list(job.drafts))
        current = held.pop() if held and own_pair else load(target, drafts, budgets)
        return current

    hooks = RunHooks(load=loaded, progress=lambda jid, total: _progress(console, jid, total), warn=warn)
    with stop_on_signals(on_first) as stop_request:
        try:
            finished = run_job(settings, job, options, hooks, stop=stop_request)
        except KeyboardInterrupt:
            click.echo(f"job {job_id}: stopped at once; finished results are saved. "
                       f"`specbatch run --resume {job_id}` finishes it.", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except (SpecBatchError, click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise
        except Exception as e:   # not a request's fault (those fail alone): the engine itself
            # a SpecBatchError: the CLI's edge prints it as one line, or the stack trace with --debug
            # (out of device memory: the resume as it was would run out again, so it says what lowers the budget)
            oom = f"; {OUT_OF_MEMORY_ADVICE}" if out_of_memory(e) else ""
            raise SpecBatchError(
                f"job {job_id} stopped: decoding failed ({type(e).__name__}: {one_line(e)}); finished results are "
                f"saved and `specbatch run --resume {job_id}` retries the rest{oom} (--debug shows the stack "
                "trace)") from e
    done()
    if held:
        held.clear()      # (a job with no route of its own pair: it was never handed out)
    for line in lines:     # why a run on a shared machine was slower than the last (engine/contention.py)
        click.echo(f"specbatch: {line}", err=True)
    _report(settings, job_id, finished, as_json)


def _report(settings: Settings, job_id: str, finished: bool, as_json: bool) -> None:
    """Print the job's summary and exit with run's status (``finished`` False: interrupted)."""
    from specbatch.jobs import store

    with open_db(settings).begin() as s:
        summary = store.job_summary(s, job_id)
    if as_json:
        echo_json(summary)
    else:
        _print_summary(summary, settings)
    if summary["status"] in ("cancelled", "cancelling"):   # `specbatch cancel`: 1, as `submit --wait`
        c = summary["request_counts"]
        click.echo(f"job {job_id} cancelled (`specbatch cancel`): {plural(c['completed'], 'result')} kept, "
                   f"{plural(c['cancelled'], 'request')} dropped", err=True)
        sys.exit(1)
    if not finished:
        left = summary["request_counts"].get("pending", 0)
        click.echo(f"job {job_id} interrupted: {plural(left, 'request')} left; "
                   f"`specbatch run --resume {job_id}` finishes it", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if summary["status"] in ("queued", "running"):
        _not_finished_here(settings, job_id)
    if summary["status"] == "failed":
        sys.exit(1)
    if summary["status"] == "completed_with_errors":
        sys.exit(EXIT_PARTIAL)


def _not_finished_here(settings: Settings, job_id: str) -> None:
    """A run that ended with its job unfinished: another process (a second `run --resume`) holds
    the rest. Exit 1: 0 would say every request completed."""
    from specbatch.jobs import store

    with open_db(settings, readonly=True).begin() as s:
        leased = store.leased_requests(s, job_id)
    holders = sorted({w for _, w, _ in leased})
    if holders:
        # "on a live lease", not "which still runs": a holder on another machine cannot be checked
        click.echo(f"job {job_id} is not finished: {plural(len(leased), 'running request')} "
                   f"{'is' if len(leased) == 1 else 'are'} held by {', '.join(holders)} on a live lease; "
                   f"`specbatch status {job_id} --watch` follows it", err=True)
    else:
        click.echo(f"job {job_id} is not finished; `specbatch run --resume {job_id}` finishes it", err=True)
    sys.exit(1)


def _resumable(settings: Settings, job_id: str) -> LocalJob:
    """The existing job ``job_id`` as a LocalJob to finish here (a missing one: ``store.get_job``'s
    one-line error); says so when nothing is left to run. Reads the database only: no torch."""
    from specbatch.worker.local import resumable_job

    job = resumable_job(open_db(settings), job_id)
    if not job.routes:
        click.echo(f"job {job.job_id}: nothing left to run ({job.status}); its summary follows", err=True)
    return job


def _load_shown(settings: Settings, options: Any, console: Any = None, asked: bool = False) -> Any:
    """``RunHooks.load``: a pair loaded under a spinner, then what compiling cost, or why not where
    ``asked`` (--compile given: auto declining on a CPU is the usual case, not news on every run)."""
    from rich.console import Console

    from specbatch.worker.local import load_pair

    shown = console or Console(stderr=True)

    use_compile_cache(settings, options.compile)

    def load(target: str, drafts: list[str], expected_new_tokens: list[int]) -> Engine:
        with loading_models(shown, target, drafts):
            engine = load_pair(settings, options, target, drafts, expected_new_tokens, notify=compiling_notice)
        report_compile(engine.compile_plan, say_eager=asked)
        return engine
    return load


@contextlib.contextmanager
def _progress(console: Any, job_id: str, total: int) -> Iterator[Callable[[Any], None]]:
    """``RunHooks.progress``: a bar with tokens per second and acceptance so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    agg = {"tokens": 0, "drafted": 0, "accepted": 0, "failed": 0, "cached": 0}
    start = time.monotonic()
    if not console.is_terminal:
        # a bar redirected to a file is drawn only when it ends: say now which job runs, so a log
        # watched during a long run names what `status` can be asked about
        console.print(f"job {job_id}: {plural(total, 'request')} running; `specbatch status {job_id}` "
                      "shows progress", soft_wrap=True, highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[speed]}"), TimeElapsedColumn(), console=console,
                  transient=False) as progress:
        task = progress.add_task(f"job {job_id}", total=total, speed="")

        def on_progress(event: Any) -> None:
            if event.output is not None:
                for sample in event.output.samples:   # (a request with n > 1: every sample)
                    st = sample.stats
                    agg["tokens"] += st.new_tokens
                    agg["drafted"] += st.drafted_tokens
                    agg["accepted"] += st.accepted_tokens
                agg["cached"] += int(event.cached)
            else:
                agg["failed"] += 1
            elapsed = max(time.monotonic() - start, 1e-9)
            # "acceptance 0%" where nothing was drafted read as drafts all rejected
            acc = f"acceptance {agg['accepted'] / agg['drafted']:.0%}" if agg["drafted"] else "nothing drafted"
            speed = f"{agg['tokens'] / elapsed:.1f} tok/s  {acc}"
            if agg["cached"]:
                speed += f"  cached {agg['cached']}"
            if agg["failed"]:
                speed += f"  failed {agg['failed']}"
            progress.update(task, advance=1, speed=speed)

        yield on_progress


def _print_summary(summary: dict[str, Any], settings: Settings) -> None:
    from rich.console import Console
    from rich.table import Table

    counts = summary.get("request_counts", {})
    stats = summary.get("stats", {}) or {}
    table = Table(title=f"job {summary.get('id')}: {summary.get('status')}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("target", str(summary.get("target")))
    table.add_row("drafts", ", ".join(summary.get("drafters", summary.get("drafts")) or []) or "-")   # --ngram too
    for key in ("total", "completed", "failed", "cancelled", "pending", "running"):
        if key in counts:
            table.add_row(f"requests {key}", str(counts[key]))
    for key, value in stats.items():
        if key == "speculation_disabled":   # requests the draft-length controller turned off: the
            continue                         # speculation line says so, "0" above "off" read as a contradiction
        if key.startswith("grammar_") and not stats.get("grammar_drafted_tokens"):
            continue                         # (no structured output drafted: three zeros read as noise)
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict | list):
            continue
        table.add_row(key, "-" if value is None else str(value))    # (no tokens: a job cancelled early)
    if (stats.get("batching") or {}).get("batch_size_share"):
        from specbatch.cli.render import batching_line

        table.add_row("batch sizes", batching_line(stats["batching"]))
    from specbatch.cli.render import speculation_line

    if line := speculation_line(summary):     # a first run with a draft that never drafted reads as broken
        table.add_row("speculation", line)
    Console().print(table)
    from specbatch.cli.render import failure_lines

    for line in failure_lines(summary):
        click.echo(f"failed: {line}", err=True)
    click.echo(f"results: {mask(settings.database_url)} (job {summary.get('id')}); "
               f"`specbatch export {summary.get('id')} -o FILE` writes them to a file")
