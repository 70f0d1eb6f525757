"""Alembic environment: runs inside specbatch (``specbatch db upgrade``) or the ``alembic`` CLI."""

from __future__ import annotations

from alembic import context

from specbatch.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from specbatch.db import _create

        engine = _create(config.get_main_option("sqlalchemy.url"))
    # one transaction for the whole upgrade: DDL is transactional on SQLite and PostgreSQL, and two
    # processes migrating a new database at once queue up (BEGIN IMMEDIATE / advisory lock) instead
    # of racing; the second then finds the schema at head and does nothing.
    with engine.connect() as conn, conn.begin():
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7368420531)")
        context.configure(connection=conn, target_metadata=target_metadata,
                          render_as_batch=conn.dialect.name == "sqlite", compare_type=True)
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
