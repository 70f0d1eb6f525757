"""Results out, for datasets: JSONL (OpenAI's batch output lines), CSV, Parquet (typed columns).

    with session_factory(url, readonly=True).begin() as s:
        n = export_job(s, job_id, "parquet", "out.parquet", statuses=["completed"])
        n_out, n_err = write_openai(s, job_id, "output.jsonl", "errors.jsonl")

Rows come in input-line order. JSONL holds finished requests unless ``statuses`` asks for others
(specbatch.jobs.openai_output); CSV and Parquet hold every request (specbatch.jobs.table). A path
is written atomically (a temporary file beside it, then a rename) and an existing file is kept
unless ``force``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy.orm import Session

from specbatch.db.models import Job, Request, Result
from specbatch.errors import SpecBatchError
from specbatch.jobs.openai_output import is_output_line, iter_rows, openai_lines
from specbatch.jobs.table import FLAT_COLUMNS, flat_record, parquet_record, parquet_schema

FORMATS = ("jsonl", "csv", "parquet")
BATCH_ROWS = 1000

__all__ = ["FLAT_COLUMNS", "FORMATS", "export_job", "write_openai"]


class ExportExists(SpecBatchError):
    """The export would overwrite a file."""


def _write_parquet(rows: Iterator[tuple[Job, Request, Result | None]], path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    n = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(parquet_record(*row))
            if len(batch) >= BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                n, batch = n + len(batch), []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def _write_csv(rows: Iterator[tuple[Job, Request, Result | None]], fp: TextIO) -> int:
    writer = csv.DictWriter(fp, fieldnames=FLAT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    n = 0
    for row in rows:
        writer.writerow(flat_record(*row))
        n += 1
    return n


def _jsonl(line: dict[str, Any]) -> str:
    return json.dumps(line, ensure_ascii=False) + "\n"


STALE_TMP_SECONDS = 3600
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")      # _atomic's own temporary names


def sweep_stale_tmps(directory: Path, now: float | None = None) -> list[Path]:
    """Remove temporary files an export killed mid-write left in ``directory`` (our own pattern,
    ``.NAME.PID.tmp``, untouched for an hour: a live export rewrites its file all the time)."""
    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not _TMP.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


@contextlib.contextmanager
def _atomic(paths: Sequence[Path], force: bool) -> Iterator[list[Path]]:
    """Temporary files beside ``paths``, renamed over them only if the block succeeds."""
    if not force:
        for p in paths:
            if p.exists():
                raise ExportExists(f"{p} exists; give --force to overwrite it")
    for d in {p.parent for p in paths}:
        sweep_stale_tmps(d)
    tmps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in paths]
    try:
        yield tmps
        for tmp, p in zip(tmps, paths):
            os.replace(tmp, p)
    except OSError as e:
        # named by the user's file, not the temporary one the write goes through (pyarrow puts
        # the temporary's name in its message, with no filename or strerror)
        what, where = e.strerror or str(e), e.filename
        for tmp, p in zip(tmps, paths):
            what = what.replace(str(tmp), str(p))
            where = str(p) if where is not None and str(where) == str(tmp) else where
        # (OSError(errno, ...) is the errno's own subclass again: a BrokenPipeError stays one)
        raise (OSError(e.errno, what, where) if e.errno is not None else OSError(what)) from e
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def write_openai(s: Session, job_id: str, output: str | Path | TextIO, errors: str | Path | TextIO | None = None,
                 *, statuses: Sequence[str] | None = None, expired: bool = False,
                 force: bool = False) -> tuple[int, int]:
    """Write the job's OpenAI batch lines: successes to ``output``, the rest to ``errors`` (OpenAI's
    output/error file pair), or every line to ``output`` when ``errors`` is None. Returns the two
    line counts (the second is 0 without ``errors``)."""
    if isinstance(output, (str, Path)) and isinstance(errors, (str, Path)) and \
            Path(output).resolve() == Path(errors).resolve():
        raise ValueError("the output and error files must differ")
    lines = openai_lines(s, job_id, statuses, expired=expired)
    counts = [0, 0]

    def write(out_fp: TextIO, err_fp: TextIO | None) -> None:
        for line in lines:
            to_errors = err_fp is not None and not is_output_line(line)
            (err_fp if to_errors and err_fp is not None else out_fp).write(_jsonl(line))
            counts[1 if to_errors else 0] += 1

    files = [x for x in (output, errors) if isinstance(x, (str, Path))]
    with _atomic([Path(x) for x in files], force) as tmps, contextlib.ExitStack() as stack:
        opened = iter(stack.enter_context(t.open("w", encoding="utf-8", newline="")) for t in tmps)
        out_fp = next(opened) if isinstance(output, (str, Path)) else output
        err_fp = None if errors is None else next(opened) if isinstance(errors, (str, Path)) else errors
        write(out_fp, err_fp)
    return counts[0], counts[1]


def export_job(s: Session, job_id: str, fmt: str, out: str | Path | TextIO,
               statuses: Sequence[str] | None = None, *, force: bool = False) -> int:
    """Write the job's rows to ``out`` (a path, or a text stream for jsonl/csv); returns the count."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "jsonl":
        return write_openai(s, job_id, out, statuses=statuses, force=force)[0]
    rows = iter_rows(s, job_id, statuses)
    if not isinstance(out, (str, Path)):
        if fmt == "parquet":
            raise ValueError("parquet is written to a file, not a stream")
        return _write_csv(rows, out)
    with _atomic([Path(out)], force) as (tmp,):
        if fmt == "parquet":
            return _write_parquet(rows, tmp)
        with tmp.open("w", encoding="utf-8", newline="") as fp:
            return _write_csv(rows, fp)
