"""Can the API's reads share the store engine's PostgreSQL pool? CPU per read of three designs,
in one process, interleaved A B C C B A, ``ROUNDS`` times:

    python scripts/pool_reads.py postgresql+psycopg://postgres@127.0.0.1:5432/DB 3000 [ROUNDS]

A: reads on an engine of their own, ``isolation_level="AUTOCOMMIT"`` at ``create_engine`` (what
   ``db.read_engine`` does: two pools a process).
B: the store engine's pool, ``engine.execution_options(isolation_level="AUTOCOMMIT")``: each
   checkout switches the connection to autocommit, each checkin back.
C: one pool in autocommit, a ``begin`` event listener sending BEGIN except on the reads' view
   (an execution option), as ``db`` does for SQLite.

A read is ``with engine.connect() as c: c.execute(SELECT 1)``, one thread; each engine keeps 8
connections. Prints each run's CPU and wall microseconds per read and the medians.
"""

from __future__ import annotations

import statistics
import sys
import time

from sqlalchemy import create_engine, event, text


def main() -> None:
    url, n = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    q = text("SELECT 1")
    store = create_engine(url, pool_size=8, max_overflow=8)
    auto = create_engine(url, pool_size=8, max_overflow=8, isolation_level="AUTOCOMMIT")

    def begin(conn):  # noqa: ANN001, ANN202
        if not conn.get_execution_options().get("no_transaction"):
            conn.exec_driver_sql("BEGIN")
    event.listen(auto, "begin", begin)
    designs = {"A": create_engine(url, pool_size=8, max_overflow=8, isolation_level="AUTOCOMMIT",
                                  pool_reset_on_return=None),
               "B": store.execution_options(isolation_level="AUTOCOMMIT"),
               "C": auto.execution_options(no_transaction=True)}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in designs}
    for _ in range(rounds):
        for name in "ABCCBA":
            engine = designs[name]
            for _ in range(200):
                with engine.connect() as c:
                    c.execute(q).scalar_one()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                with engine.connect() as c:
                    c.execute(q).scalar_one()
            cpu, wall = 1e6 * (time.process_time() - c0) / n, 1e6 * (time.perf_counter() - w0) / n
            got[name].append((cpu, wall))
            load = " ".join(open("/proc/loadavg").read().split()[:3])
            print(f"{name} cpu {cpu:.0f} us/read  wall {wall:.0f} us/read  load {load}", flush=True)
    for name, runs in got.items():
        print(f"{name} median cpu {statistics.median(c for c, _ in runs):.0f} us, "
              f"wall {statistics.median(w for _, w in runs):.0f} us")


if __name__ == "__main__":
    main()
