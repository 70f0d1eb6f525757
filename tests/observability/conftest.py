"""The worker tests' real services (Redis on a free port, worker subprocesses, a tmp SQLite file)."""

from tests.worker.conftest import cluster, redis_server  # noqa: F401
