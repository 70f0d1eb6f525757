"""Entry point: one Click group; each command group lives in its own module."""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import signal
import sys

import click

from specbatch.cli.json_out import JSON_ASKED, echo_json_error
from specbatch.errors import (
    OUT_OF_MEMORY_ADVICE,
    InputError,
    IntakeError,
    SettingsError,
    SpecBatchError,
    one_line,
    out_of_memory,
)
from specbatch.redact import install_log_redaction, mask

# module -> command names it defines (imported lazily so `specbatch --help` stays fast)
COMMAND_MODULES = {
    "specbatch.cli.generate": ("generate", "models"),
    "specbatch.cli.jobs": ("jobs", "status", "export", "cancel", "retry", "db"),
    "specbatch.cli.queue": ("submit", "run", "worker", "resume", "flower"),
    "specbatch.cli.bench": ("bench",),
    "specbatch.cli.cache": ("cache",),
    "specbatch.cli.audit": ("audit",),
    "specbatch.cli.serve": ("serve",),
}


class LazyGroup(click.Group):
    """Loads a command's module on first use; turns SpecBatchError into one readable line, and
    masks credentials in every error it lets through."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for names in COMMAND_MODULES.values() for name in names)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        for module, names in COMMAND_MODULES.items():
            if cmd_name in names:
                return getattr(importlib.import_module(module), cmd_name.replace("-", "_"))
        return None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # noted before the command parses its own options: a usage error answers in JSON too
        ctx.meta[JSON_ASKED] = "--json" in (args[:args.index("--")] if "--" in args else args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):  # type: ignore[no-untyped-def]
        try:
            return super().invoke(ctx)
        except SpecBatchError as e:
            if ctx.obj and ctx.obj.get("debug"):
                _mask_chain(e)   # the stack trace asked for, its credentials masked like the rest
                raise
            error = click.ClickException(mask(str(e)))
            if _usage(e):
                error.exit_code = 2   # a usage error, like a bad option
            echo_json_error(ctx, error, e)
            raise error from e
        except click.ClickException as e:
            e.message = mask(e.message)
            echo_json_error(ctx, e, e)
            raise
        except BrokenPipeError:
            # the reader of stdout went away (`specbatch export JOB | head`): stop quietly, as a
            # shell tool killed by SIGPIPE does; stdout goes to /dev/null so the interpreter's
            # final flush does not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise                # (RuntimeErrors to Python, control flow to click)
        except Exception as e:   # a bug: one line for the user, the stack trace with --debug
            if ctx.obj and ctx.obj.get("debug"):
                _mask_chain(e)
                raise
            # (a GPU that ran out of memory, a database lost mid-command or one another process kept
            # locked is no bug to report: it is told what lowers the budget, or what to rerun)
            error = click.ClickException(mask(f"{OUT_OF_MEMORY_ADVICE} ({type(e).__name__}: {one_line(e)})"
                                              if out_of_memory(e) else _database_lost(e) or _database_busy(e) or
                                              f"unexpected error ({type(e).__name__}: {one_line(e)}); --debug shows "
                                              "the stack trace; please report it"))
            echo_json_error(ctx, error, e)
            raise error from e


def _database_lost(e: Exception) -> str | None:
    """One line for a database that stopped answering after the command opened it (a server
    restarted or gone mid-command: SQLAlchemy's OperationalError); a command that cannot open it
    at all says so where it opens it (``cli.common.database_error``)."""
    if type(e).__module__.split(".")[0] != "sqlalchemy":
        return None
    from sqlalchemy.exc import OperationalError

    if not isinstance(e, OperationalError) or not (e.connection_invalidated or _connection_failed(e.orig)):
        return None    # (a missing column, a read-only file, a full disk: rerunning fixes none of them)
    return (f"the database stopped answering ({one_line(e.orig or e)}): what was written before stays; "
            "run the command again once it answers (--debug shows the stack trace)")


# SQLite's extended SQLITE_BUSY codes whose cause is not a lock held past the busy timeout
# (sqlite.org/rescode.html); SQLITE_LOCKED (6) is no busy database: a conflict inside one
# connection, a bug, left to "unexpected error"
SQLITE_BUSY_RECOVERY, SQLITE_BUSY_SNAPSHOT = 261, 517


def _database_busy(e: Exception) -> str | None:
    """One line for SQLite's "database is locked" (SQLITE_BUSY and its extended codes): another
    process (a worker, a second command) held the file's write lock past the busy timeout every
    connection waits, was recovering the log after a crash, or wrote after this command read."""
    if type(e).__module__.split(".")[0] != "sqlalchemy":
        return None
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from specbatch.db import SQLITE_BUSY_TIMEOUT_MS

    if not isinstance(e, OperationalError) or not isinstance(e.orig, sqlite3.OperationalError):
        return None
    code = getattr(e.orig, "sqlite_errorcode", 0)
    if code & 0xFF != sqlite3.SQLITE_BUSY:
        return None
    rerun = "what was written before stays; run the command again (--debug shows the stack trace)"
    if code == SQLITE_BUSY_SNAPSHOT:   # SQLite fails it at once: no waiting would have helped
        return ("the database changed under this command: another process wrote to it after this command "
                f"began reading, so its read could not become a write (SQLite's SQLITE_BUSY_SNAPSHOT); {rerun}")
    held = ("was recovering its write-ahead log after a crash" if code == SQLITE_BUSY_RECOVERY
            else "held its write lock")
    return (f"the database was busy: another process {held} for over {SQLITE_BUSY_TIMEOUT_MS / 1000:g} s "
            f"(SQLite's busy timeout); {rerun}")


def _connection_failed(orig: BaseException | None) -> bool:
    """psycopg's error for a connection that could not be made (no SQLSTATE: the client's own),
    lost (class 08) or ended by the server (57P: a shutdown, a restart)."""
    if orig is None or type(orig).__module__.split(".")[0] != "psycopg":
        return False
    state = getattr(orig, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))


def _usage(e: SpecBatchError) -> bool:
    """A bad setting, or bad option values with no file line to blame (``--model-map``,
    ``--sample``): bad usage, exit 2, as click's own option checks (``--temperature -1``) are."""
    if isinstance(e, SettingsError):
        return True
    errors = e.errors if isinstance(e, IntakeError) else [e] if isinstance(e, InputError) else []
    return bool(errors) and all(x.path is None and x.line_no is None and (x.field or "").startswith("--")
                                for x in errors)


def _mask_chain(error: BaseException | None) -> None:
    """Mask credentials in the messages of ``error`` and the exceptions chained to it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.args = tuple(mask(a) if isinstance(a, str) else a for a in error.args)
        error = error.__cause__ or error.__context__


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show stack traces and debug logs.")
@click.version_option(package_name="specbatch")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """specbatch: lossless speculative decoding for batch generation."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()


def _freeze_at_exit() -> None:
    # the interpreter's last garbage collections walk every object a loaded model left behind (0.6 s
    # of a `specbatch run`'s 0.8 s exit after its summary, measured with py-spy --native); the
    # process is ending, so those objects are frozen out of them. What relied on being collected
    # then is closed first: the database's pooled connections (SQLite's WAL, db.close_at_exit)
    if (db := sys.modules.get("specbatch.db")) is not None:     # (imported only where it was used)
        db.close_at_exit()
    gc.freeze()


def main() -> None:
    # atexit: after the threads are joined; run last of the handlers, as registered first
    atexit.register(_freeze_at_exit)
    cli(obj={})
