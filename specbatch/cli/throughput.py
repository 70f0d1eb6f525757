"""Options that set how fast a job runs: --batch-size, --max-memory, --threads, --no-speculation.

Shared by ``run`` and ``worker``; bad values are usage errors (exit 2) naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from specbatch.config import Settings


class BatchSizeType(click.ParamType):
    name = "auto|N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from specbatch.engine.autopilot import check_batch_size

        try:
            return check_batch_size(value)
        except ValueError as e:
            self.fail(f"{value!r}: {e}", param, ctx)


class BytesType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from specbatch.engine.memory import parse_bytes

        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class EngineChecked(click.ParamType):
    """A value the engine's own check accepts (``check`` names a function of
    specbatch.engine.loading, imported only when the option is given: it needs torch). A typo is a
    usage error; a device this machine lacks is found when the models load (exit 1)."""

    def __init__(self, name: str, check: str) -> None:
        self.name, self.check = name, check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from specbatch.engine import loading
        from specbatch.errors import SpecBatchError

        try:
            getattr(loading, self.check)(value)
        except (ValueError, SpecBatchError) as e:
            self.fail(str(e), param, ctx)
        return value


def device_options(f: Any) -> Any:
    """--device and --dtype, for every command that loads models."""
    f = click.option("--dtype", type=EngineChecked("DTYPE", "resolve_dtype"), default=None,
                     help="float32, bfloat16 or float16 (default: SPECBATCH_DTYPE, float32). float32 is token-exact "
                          "against the target alone; in 16 bits batching itself moves near-ties (docs/DESIGN.md, "
                          "\"Batch invariance\").")(f)
    return click.option("--device", type=EngineChecked("DEVICE", "parse_device"), default=None,
                        help="cpu, cuda, cuda:N or mps (default: SPECBATCH_DEVICE, cpu).")(f)


def threads_option(f: Any) -> Any:
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="torch CPU threads for this process [SPECBATCH_THREADS; default: usable cores / "
                             "SPECBATCH_LOCAL_WORKERS, at most OMP_NUM_THREADS where set].")(f)


def prefix_cache_option(f: Any) -> Any:
    return click.option("--no-prefix-cache", is_flag=True,
                        help="Prefill every prompt whole: do not compute prompt prefixes that requests "
                             "share once (to measure what that saves) [SPECBATCH_PREFIX_CACHE=0].")(f)


def throughput_options(f: Any) -> Any:
    f = click.option("--no-speculation", is_flag=True,
                     help="Plain decoding with the target alone (same as --draft none).")(f)
    f = threads_option(f)
    f = prefix_cache_option(f)
    f = click.option("--max-memory", type=BytesType(), default=None,
                     help="Memory budget for KV caches and activations, e.g. 8GiB or 512MB "
                          "[SPECBATCH_MAX_MEMORY; default: half the free RAM, 80% of free GPU memory].")(f)
    f = click.option("--batch-size", type=BatchSizeType(), default=None,
                     help="Requests decoded together: 'auto' (by measurement) or N "
                          "[SPECBATCH_BATCH_SIZE, default auto].")(f)
    return f


@dataclass(frozen=True)
class Throughput:
    batch_size: int | str
    max_memory: int | None
    threads: int | None
    prefix_cache: bool = True


def resolve_throughput(settings: Settings, batch_size: int | str | None, max_memory: int | None,
                       threads: int | None, no_prefix_cache: bool = False) -> Throughput:
    """Options over settings (which validated their own values)."""
    from specbatch.engine.memory import parse_bytes

    if max_memory is None and settings.max_memory:
        max_memory = parse_bytes(settings.max_memory)
    return Throughput(settings.batch_size if batch_size is None else batch_size, max_memory,
                      threads or settings.threads or None, settings.prefix_cache and not no_prefix_cache)


def no_draft(drafts: tuple[str, ...], no_speculation: bool) -> bool:
    """--no-speculation, or --draft none: the target alone."""
    if [d.lower() for d in drafts] == ["none"]:
        return True
    if "none" in (d.lower() for d in drafts):
        raise click.BadParameter("'none' cannot be combined with other drafts", param_hint="--draft")
    return no_speculation
