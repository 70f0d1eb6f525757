"""Small helpers shared by the command modules (keep this file small; see docs/CONTRACTS.md)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator, Sequence
from typing import Any

import click
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from specbatch.config import Settings
from specbatch.errors import one_line
from specbatch.redact import mask


def open_db(settings: Settings, readonly: bool = False, create: bool = False) -> sessionmaker:
    """The session factory for ``settings.database_url``. ``readonly``: for long reads that must not
    hold SQLite's write lock. ``create``: only for commands that store new jobs (submit, run, serve);
    they may create a missing SQLite file and say so on stderr. Every other command reads or changes
    jobs that must already exist, so a missing file is a one-line error (exit 1) naming where it
    looked: creating an empty database there would hide a mistyped SPECBATCH_DATABASE_URL behind
    "no jobs". A bad URL is a usage error (exit 2); a database that cannot be opened, exit 1."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from specbatch.db import session_factory, sqlite_path

    url = settings.database_url
    try:
        path = sqlite_path(url)
        shown = shown_url(url)
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        raise click.UsageError(mask(f"SPECBATCH_DATABASE_URL={url!r} is not a database URL: {e}")) from e
    is_new = path is not None and not path.exists()
    from_env = "database_url" in settings.model_fields_set     # (given: SPECBATCH_DATABASE_URL)
    if is_new and not create:
        where = "SPECBATCH_DATABASE_URL" if from_env else "the default; SPECBATCH_DATABASE_URL picks another"
        if not path.is_absolute():   # sqlite:///tmp/x.db is tmp/x.db here, a common slip
            where += (f": sqlite:///{path} is relative to the current directory; an absolute path takes "
                      f"four slashes, sqlite:////{path}")
            path = path.absolute()
        raise click.ClickException(f"no database at {path} ({where}); nothing has been stored there yet: "
                                   "`specbatch run FILE` or `specbatch submit FILE` creates it")
    try:
        factory = session_factory(url, readonly=readonly)
    except (ArgumentError, NoSuchModuleError) as e:
        raise click.UsageError(f"SPECBATCH_DATABASE_URL={shown!r}: {e}") from e
    except OperationalError as e:
        raise database_error("open", shown, e) from e
    except OSError as e:
        raise click.ClickException(f"cannot create the database {shown}: {e}") from e
    if is_new:
        hint = "" if from_env else " (set SPECBATCH_DATABASE_URL to use another)"
        click.echo(f"specbatch: created a new database at {path}{hint}", err=True)
    return factory


def shown_url(url: str) -> str:
    """The database URL as the CLI shows it: its host and database, the password hidden."""
    from sqlalchemy.engine import make_url

    return mask(make_url(url).render_as_string(hide_password=True))


def database_error(doing: str, shown: str, error: OperationalError) -> click.ClickException:
    """A database that cannot be reached or refused the connection, as one line naming it
    (``shown``: ``shown_url``): the driver's message may go on over several lines (psycopg's
    "connection refused" with "\\n\\tIs the server running on that host ...?")."""
    return click.ClickException(f"cannot {doing} the database {shown}: {one_line(error.orig or error)}")


def require_extra(extra: str, modules: Sequence[str], needs: str) -> None:
    """A one-line error (exit 1) naming ``extra`` when any of its ``modules`` is not installed.
    Found without importing them, before any work: a module imported only at the end (bench's plots,
    the server's form parser) surfaced as an "unexpected error" after minutes of measuring."""
    if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
        raise click.ClickException(f"{needs} needs the {extra} extra (missing: {', '.join(missing)}): "
                                   f"pip install 'specbatch[{extra}]' (in a checkout: pip install -e '.[{extra}]')")


@contextlib.contextmanager
def loading_models(console: Any, target: str, drafts: Sequence[str]) -> Iterator[None]:
    """Say on stderr (``console``: a rich Console on it) which models load: a spinner in a terminal,
    one line elsewhere (a spinner is not drawn into a pipe or a log, where loading read as a hang)."""
    what = f"loading {target}"
    if drafts:
        what += f" and its draft{'s' if len(drafts) > 1 else ''} {', '.join(drafts)}"
    what += " ..."
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        console.print(what, soft_wrap=True, highlight=False, markup=False)
        yield


def warn(message: str) -> None:
    """A warning for people, on stderr (never mixed into --json output); credentials masked."""
    click.secho(f"warning: {mask(message)}", err=True, fg="yellow")


def check_device(device: str) -> None:
    """Refuse an unknown or absent device (``--device cuda`` on a machine without CUDA) before
    anything else is said or loaded: advice for that device (``check_pair_device``) and a "loading"
    line would only precede the same error, and a worker would first wait for its broker."""
    from specbatch.engine.loading import resolve_device

    resolve_device(device)     # DeviceError: one line at the CLI edge, exit 1


def check_pair_device(target: str, drafts: Sequence[str], device: str) -> None:
    """Before a model loads (run, worker, generate): the device is refused if absent
    (``check_device``), else one line where an int8 draft of the pool (drafter specs) would run off
    the CPU (``known_models.int8_off_cpu``): there it is unquantized, and the default pair's draft
    is then as costly as its target."""
    check_device(device)
    from specbatch.engine.drafter_specs import model_names, parse_drafters
    from specbatch.engine.known_models import int8_off_cpu
    from specbatch.errors import SpecBatchError

    try:
        names = model_names(parse_drafters(list(drafts)))
    except SpecBatchError:     # not a pool: loading says so in its own words
        return
    if (line := int8_off_cpu(target, names, device)) is not None:
        warn(line)


def check_queue_workers(settings: Any, queue: str, advice: str, states: bool = False) -> None:
    """On stderr: a worker still starting for ``queue`` and its state (so nobody starts a second
    one), else a warning when no live worker consumes it (``advice``: how to start one), or that
    the broker cannot be asked; ``states``: also each consuming worker's state (compiling ...)."""
    from specbatch.worker.monitor import elsewhere, none_consumes, queue_workers, this_database

    workers = queue_workers(settings, queue)
    if workers is None:
        warn(f"the broker at {settings.broker_url} is unreachable; cannot tell whether a worker is running")
        return
    here = this_database(settings, workers)
    away = elsewhere(workers, here)
    for w in workers:
        if w.name in away:
            warn(f"worker {w.name} consumes queue {queue} but reads another database (id {w.database}; this "
                 f"one's is {here}): it passes this database's tasks on unrun; give it the "
                 "SPECBATCH_DATABASE_URL this command uses")
        elif w.paused:
            warn(f"worker {w.name} is online for queue {queue} but does not consume it: it paused "
                 "itself (its log's 'paused:' line says why)")
        elif not w.consuming:
            click.echo(f"worker {w.name} is starting for queue {queue} ({w.state}); "
                       "tasks wait in the queue until it consumes", err=True)
        elif states and w.state and not w.state.startswith("ready"):
            click.echo(f"worker {w.name}: {worker_state(w.state)}", err=True)
    if none_consumes(workers, here):
        warn(f"no live worker consumes queue {queue}: {advice}")


def worker_state(state: str) -> str:
    """A worker's state for people: "eager: WHY" (the engine's word for not compiled) reads as
    decoding, which is what the worker does; "auto: " (the plan's record of who declined) is dropped."""
    if state.startswith("eager: "):
        return f"decoding, not compiled: {state.removeprefix('eager: ').removeprefix('auto: ')}"
    return state


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (click lets nan through every bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


# The generation options' types: exactly what GenerationParams.validate accepts (engine/types.py),
# so a bad value on the command line is a usage error (exit 2) naming the option, before any
# model loads. The engine keeps its own check for library callers and per-line file values.
TEMPERATURE = FiniteFloatRange(min=0, max=2)                 # [0, 2] as OpenAI; 0: greedy
TOP_P = FiniteFloatRange(min=0, max=1, min_open=True)        # (0, 1]
TOP_K = click.IntRange(min=0)                                # 0: no top-k
SEED = click.IntRange(min=0, max=2**63, max_open=True)       # [0, 2**63)
GAMMA = click.IntRange(min=0, max=64)


def nonempty_stops(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """--stop callback: an empty stop string is refused, as GenerationParams.validate does."""
    if any(s == "" for s in value):
        raise click.BadParameter("stop strings must not be empty", ctx=ctx, param=param)
    return value


def compile_option(f: Any) -> Any:
    """--compile auto|on|off|static (default: SPECBATCH_COMPILE, itself auto). See docs/COMPILE.md."""
    return click.option("--compile", "compile_", type=click.Choice(["auto", "on", "off", "static"]), default=None,
                        help="torch.compile the models before decoding: on (minutes the first time on a "
                             "CPU; a stderr line says when it is ready), off, or auto (only where compiling is "
                             "expected to gain over 1.05x here and, on run and generate, the job's saved decoding "
                             "time exceeds the compile time; else a stderr line says why, except on a generate "
                             "that did not ask); static: the target over a static KV cache, its "
                             "few-row one-token steps compiled (minutes) "
                             "[default: SPECBATCH_COMPILE or auto].")(f)
