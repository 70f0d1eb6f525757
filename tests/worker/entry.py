"""Tests only: start a worker like `specbatch worker`, with extra modules imported in the pool child.

    python -m tests.worker.entry --target T --draft D -n name@%h --imports tests.worker.poison_hook
"""

from __future__ import annotations

import sys

import click

from specbatch.config import get_settings
from specbatch.worker.runner import run_worker


@click.command()
@click.option("--target", required=True)
@click.option("--draft", "drafts", multiple=True)
@click.option("--hostname", "-n", default=None)
@click.option("--imports", multiple=True)
@click.option("--compile", "compile_", default=None)
def main(target: str, drafts: tuple[str, ...], hostname: str | None, imports: tuple[str, ...],
         compile_: str | None) -> None:
    code, error = run_worker(get_settings(), target=target, drafts=drafts, hostname=hostname,
                             imports=imports, compile=compile_)
    if error:
        click.echo(f"cannot load models: {error}", err=True)
    sys.exit(code or (3 if error else 0))


if __name__ == "__main__":
    main()
