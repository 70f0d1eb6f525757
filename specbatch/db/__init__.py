"""Engines, sessions and migrations for the job store (SQLite by default, PostgreSQL by URL).

    from specbatch.db import session_factory
    with session_factory(settings.database_url).begin() as s:
        job = store.get_job(s, job_id)

The first ``get_engine(url)`` in a process brings the schema to the newest migration (a new
SQLite file is created, parent directories too). SQLite connections run in WAL mode with a busy
timeout, and every transaction starts with ``BEGIN IMMEDIATE``: writers queue for the lock instead
of failing with "database is locked" when two of them upgrade a read to a write at once.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker
from sqlalchemy.pool import StaticPool

from specbatch.redact import mask

# alembic logs its plugin set-up and dialect at INFO on every start (nine lines per process in a
# worker's log); specbatch says "migrating ..." itself when it migrates. Set here, before any
# `from alembic import ...` below: the first import is what sets the plugins up and logs them
logging.getLogger("alembic").setLevel(logging.WARNING)

logger = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 60_000
MIGRATIONS_DIR = Path(__file__).parent / "migrations"

_engines: dict[str, Engine] = {}
_read_engines: dict[str, Engine] = {}
_factories: dict[tuple[str, bool], sessionmaker] = {}
_lock = threading.RLock()
_FORKED_AWAY: list[Any] = []    # a forked child's pools of its parent's connections (forget_engines)


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL; None for other backends and in-memory databases."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    if u.database.startswith("file:"):
        return None
    return Path(u.database).expanduser()


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None         # we emit BEGIN ourselves (see _sqlite_begin)
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = NORMAL")   # safe with WAL; fsync at checkpoints
    cur.execute("PRAGMA foreign_keys = ON")
    cur.close()


def _sqlite_begin(conn: Any) -> None:
    # take the write lock up front; the busy timeout then covers the whole wait. Read-only
    # sessions (exports, reports) begin deferred: in WAL mode they never block a writer.
    readonly = conn.get_execution_options().get("specbatch_readonly", False)
    conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


SQLITE_MAGIC = b"SQLite format 3\x00"


def _check_sqlite_file(path: Path) -> None:
    """Refuse an existing file that is not a SQLite database (say, the prompt file) before SQLite
    writes into it. Only here, before this process opens a connection to it: closing any other
    descriptor of the file drops every POSIX lock SQLite holds on it in this process."""
    from specbatch.errors import SpecBatchError

    if path.is_file() and path.stat().st_size > 0:
        with path.open("rb") as f:
            if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                raise SpecBatchError(f"SPECBATCH_DATABASE_URL points at {path}, which exists and is not "
                                     "a SQLite database")


POOL_OVERFLOW = 8       # connections past pool_size, opened and closed per use (health checks, exports)


def _pool_args(pool_size: int | None) -> dict[str, int]:
    # SQLAlchemy's default (5 kept + 10 overflow) is for a handful of threads; a server running
    # N threads at once needs N kept connections, or it opens and closes one per request (for
    # SQLite each open runs the PRAGMAs below) and threads past 15 wait for one
    return {} if pool_size is None else {"pool_size": pool_size, "max_overflow": POOL_OVERFLOW}


# a pooled server connection idle this long is pinged before use (a server restart meanwhile would
# have closed it); one in use more recently is not. SQLAlchemy's pool_pre_ping pings on every
# checkout: one round trip of a read's 2-3 on PostgreSQL (issue 32). What a busy connection risks:
# a restart shorter than this fails the next read on it, once (the pool then drops every connection
# older than the failure); a restart while requests run fails those anyway, ping or not
IDLE_PING_SECONDS = 1.0


def _ping_when_idle(engine: Engine) -> None:
    def checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < IDLE_PING_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:      # the pool reconnects (SQLAlchemy's "disconnect handling - pessimistic")
            raise exc.DisconnectionError(f"a pooled connection idle for {time.monotonic() - since:.0f} s "
                                         f"is gone: {e}") from e

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)


def _create(url: str, pool_size: int | None = None, autocommit: bool = False) -> Engine:
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        # autocommit: every connection of the pool stays in autocommit, set once when it connects
        # (an isolation_level execution option sets it at each checkout and resets it at each
        # checkin), and nothing to roll back when it returns to the pool
        extra: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None} if autocommit else {}
        engine = create_engine(url, **_pool_args(pool_size), **extra)
        _ping_when_idle(engine)
        return engine
    path = sqlite_path(url)
    if path is None:    # in-memory: one shared connection, or the tables vanish
        engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
    else:
        _check_sqlite_file(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
                               **_pool_args(pool_size))
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _alembic_config(engine: Engine) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # configparser reads "%" as interpolation: a percent-encoded password ("p%40ss") must be "%%"
    # here (alembic's own CLI reads it back unescaped; our env.py uses the engine itself)
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["engine"] = engine
    return cfg


def _run_upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(_alembic_config(engine), revision)


# The newest migration's revision (a test holds it equal to Alembic's head). A database already at
# it is told by one SELECT, without importing Alembic and loading every migration script: that check
# took 1.7 s of a `specbatch status` on PostgreSQL at load 10. Any other answer takes the full check.
SCHEMA_HEAD = "0017"


def _at_head(engine: Engine) -> bool:
    # read-only: on SQLite a BEGIN IMMEDIATE here would wait for a busy writer just to read a version
    with engine.execution_options(specbatch_readonly=True).connect() as conn:   # a database down raises here
        try:
            return set(conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars()) == {SCHEMA_HEAD}
        except exc.DBAPIError:      # no alembic_version yet: a new database
            return False


def _needs_upgrade(engine: Engine) -> bool:
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from specbatch.errors import SpecBatchError

    script = ScriptDirectory.from_config(_alembic_config(engine))
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return True
        current = set(MigrationContext.configure(conn).get_current_heads())
    known = {rev.revision for rev in script.walk_revisions()}
    if current - known:
        raise SpecBatchError(f"the database {mask(str(engine.url))} is at schema "
                             f"revision {', '.join(sorted(current - known))}, newer than this specbatch "
                             "knows; upgrade specbatch")
    return current != set(script.get_heads())


def _pool_smaller(engine: Engine, pool_size: int | None) -> bool:
    size = getattr(engine.pool, "size", None)       # StaticPool (in-memory SQLite) has none
    return pool_size is not None and callable(size) and size() < pool_size


def get_engine(url: str, pool_size: int | None = None) -> Engine:
    """The engine for ``url``, cached per process; the schema is migrated to head on first use.
    ``pool_size``: connections kept for that many threads at once (the API server's); an engine
    cached with a smaller pool is replaced (its idle connections closed)."""
    with _lock:
        engine = _engines.get(url)
        if engine is not None and _pool_smaller(engine, pool_size):
            engine.dispose()
            for key in [k for k in _factories if k[0] == url]:
                del _factories[key]
            engine = None
        if engine is None:
            engine = _create(url, pool_size)
            if not _at_head(engine) and _needs_upgrade(engine):
                logger.info("migrating %s to the newest schema", mask(str(engine.url)))
                _run_upgrade(engine)
            _engines[url] = engine
        return engine


def session_factory(url: str, readonly: bool = False, pool_size: int | None = None) -> sessionmaker:
    """Use as ``with session_factory(url).begin() as s:`` (commits at the end, rolls back on error).

    ``readonly=True``: for long reads (export, status) that must not hold SQLite's write lock.
    ``pool_size``: see ``get_engine``.
    """
    with _lock:
        engine = get_engine(url, pool_size)     # a smaller pool: replaced, with its factories
        factory = _factories.get((url, readonly))
        if factory is None:
            bind = engine.execution_options(specbatch_readonly=True) if readonly else engine
            factory = _factories[(url, readonly)] = sessionmaker(bind, expire_on_commit=False)
        return factory


def read_engine(url: str, pool_size: int | None = None) -> Engine:
    """The API's short reads: ``with read_engine(url).connect() as c: c.execute(...)``, each statement
    its own snapshot, no ORM session. On PostgreSQL an engine of its own whose connections stay in
    autocommit: a transaction is two more round trips (BEGIN, COMMIT) a read, and switching a
    shared pool's connection to autocommit and back costs CPU at every checkout (issue 32; one
    pool for both measured 1.5x the CPU a read: docs/bench/api-load.md, "One pool"). Reads
    that need one snapshot across statements (exports) keep ``session_factory(readonly=True)``. On
    SQLite the engine's read-only view: its BEGIN is no round trip and never blocks a writer.
    ``pool_size``: see ``get_engine``."""
    with _lock:
        engine = get_engine(url, pool_size)     # migrated first
        if engine.dialect.name == "sqlite":
            return engine.execution_options(specbatch_readonly=True)
        reads = _read_engines.get(url)
        if reads is not None and _pool_smaller(reads, pool_size):
            reads.dispose()
            reads = None
        if reads is None:
            reads = _read_engines[url] = _create(url, pool_size, autocommit=True)
        return reads


def upgrade(url: str, revision: str = "head") -> None:
    """Alembic upgrade to ``revision`` (``specbatch db upgrade``)."""
    with _lock:
        engine = _engines.get(url) or _create(url)
        _run_upgrade(engine, revision)
        _engines.setdefault(url, engine)


def downgrade(url: str, revision: str) -> None:
    """Alembic downgrade to ``revision`` ("base": drop everything). For developers and tests."""
    from alembic import command

    with _lock:
        engine = _engines.get(url) or _create(url)
        command.downgrade(_alembic_config(engine), revision)
        _engines.setdefault(url, engine)


def current_revision(url: str) -> str | None:
    """The database's Alembic revision as it is (None: not migrated). Not through ``get_engine``,
    which migrates a database on first use: `db upgrade` read the head there before it migrated
    anything, and said "nothing to migrate" of a database it had just migrated."""
    from alembic.runtime.migration import MigrationContext

    with _lock:
        cached = _engines.get(url)
    engine = cached or _create(url)
    try:
        # read-only: on SQLite a BEGIN IMMEDIATE would wait for a busy writer just to read a version
        with engine.execution_options(specbatch_readonly=True).connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        if cached is None:
            engine.dispose()


def dispose_engines(close: bool = False) -> None:
    """Drop pooled connections; call in a child after fork (``close=False`` leaves the parent's alone)."""
    with _lock:
        _dispose_all(close)


_ids: dict[str, str] = {}     # database_id's answers, by URL: a database keeps its id for life


def database_id(url: str) -> str:
    """The random id the database at ``url`` was given when created (``specbatch_database``,
    migration 0017): what a task names its job's database by (worker/enqueue.py). Read once a
    process per URL."""
    if url not in _ids:
        from specbatch.db.models import DatabaseIdentity

        with session_factory(url, readonly=True)() as s:
            _ids[url] = s.scalars(select(DatabaseIdentity.id)).one()
    return _ids[url]


def close_at_exit() -> None:
    """At the process's exit: close the pooled connections, which nothing else closes once the
    entry point freezes what is left out of the last garbage collections (cli/main.py). Closing
    the last connection to a SQLite database checkpoints its WAL into the file and removes the
    -wal and -shm files; left open, the newest jobs stayed in the -wal only. No lock: a daemon
    thread may hold it for ever at exit."""
    _dispose_all(close=True)


def _dispose_all(close: bool) -> None:
    for engine in (*list(_engines.values()), *list(_read_engines.values())):
        engine.dispose(close=close)


def forget_engines(close: bool = True) -> None:
    """Dispose and forget every engine (tests, and before deleting a database). ``close=False``:
    in a child after a fork, whose pooled connections are the parent's; it opens its own."""
    global _lock
    if not close:
        _lock = threading.RLock()   # another thread of the parent may have held it at the fork
    with _lock:
        for engine in (*_engines.values(), *_read_engines.values()):
            if not close:   # kept, never collected here: collecting would close the parent's connections
                _FORKED_AWAY.append(engine.pool)
            engine.dispose(close=close)
        _engines.clear()
        _read_engines.clear()
        _factories.clear()
        _ids.clear()


__all__ = ["close_at_exit", "current_revision", "database_id", "dispose_engines", "downgrade", "forget_engines", "get_engine", "read_engine",
           "session_factory", "sqlite_path", "upgrade"]
