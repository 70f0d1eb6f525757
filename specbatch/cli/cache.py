"""``specbatch cache``: what the results cache holds, and forgetting it (specbatch.jobs.result_cache)."""

from __future__ import annotations

import click

from specbatch.cli.common import open_db
from specbatch.cli.json_out import echo_json
from specbatch.config import get_settings
from specbatch.plural import plural

JSON_HELP = "Print machine-readable JSON on stdout."


@click.group()
def cache() -> None:
    """The results cache: greedy requests already generated for a target are copied, not generated.

    It lives in the database (results carry a cache key). `run`/`submit --no-cache` skip it.

    \b
    Example:
      specbatch cache stats
      specbatch cache clear --target smollm2-135m
    """


@cache.command("stats")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def cache_stats(as_json: bool) -> None:
    """Entries, hits served and tokens not generated, per target.

    A target is its weights' content: two names for the same files share one row.

    \b
    Example:
      specbatch cache stats --json | jq .hits
    """
    from specbatch.jobs import result_cache

    with open_db(get_settings(), readonly=True).begin() as s:
        data = result_cache.stats(s)
    if as_json:
        echo_json(data)
        return
    click.echo(f"{plural(data['entries'], 'entry', 'entries')}, {plural(data['hits'], 'hit')} served, "
               f"{plural(data['tokens_saved'], 'token')} not generated")
    if not data["targets"]:
        return
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for col in ("target", "names", "entries", "hits", "tokens saved"):
        table.add_column(col, justify="right" if col in ("entries", "hits", "tokens saved") else "left")
    for t in data["targets"]:
        table.add_row((t["target"] or "-")[:12], ", ".join(t["names"]) or "-", str(t["entries"]),
                      str(t["hits"]), str(t["tokens_saved"]))
    Console(file=sys.stdout, highlight=False).print(table)


@cache.command("clear")
@click.option("--target", metavar="MODEL", default=None,
              help="Only this target's entries (and those of other names for the same weights).")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def cache_clear(target: str | None, as_json: bool) -> None:
    """Forget cache entries; the results themselves stay in their jobs.

    \b
    Example:
      specbatch cache clear
      specbatch cache clear --target ./my-model
    """
    from specbatch.jobs import result_cache

    with open_db(get_settings()).begin() as s:
        n = result_cache.clear(s, target)
    if as_json:
        echo_json({"cleared": n, "target": target})
    elif target is not None and n == 0:
        from specbatch.engine.known_models import misspelt

        meant = misspelt(target)
        click.echo(f"no cache entries for target {target}" + (f" (did you mean {meant}?)" if meant else ""))
    else:
        click.echo(f"cleared {plural(n, 'cache entry', 'cache entries')}" + (f" of target {target}" if target else ""))
