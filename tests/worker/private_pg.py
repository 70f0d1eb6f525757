"""A private PostgreSQL server for outage tests: its own data directory and free port, stoppable.

``pg_ctl`` refuses to run as root, so as root every command runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.worker.services import free_port


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


class PrivatePostgres:
    def __init__(self) -> None:
        bindir = _bindir()
        if bindir is None:
            raise RuntimeError("pg_ctl not found")
        self.bin = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="specbatch-pg-"))   # outside pytest's 0700 tmp
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        os.chmod(self.root, 0o777)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def init(self) -> PrivatePostgres:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        return self.start()

    def start(self) -> PrivatePostgres:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.log), "-w", "start")
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
