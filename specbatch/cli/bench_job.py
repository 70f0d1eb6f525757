"""`specbatch bench --job FILE`: load the pair, read the file, run ``specbatch.bench.job``, report."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from specbatch.cli.common import echo_json, warn
from specbatch.config import Settings


def bench_job(settings: Settings, file: str, target: str | None, drafts: tuple[str, ...],
              sizes: tuple[int, ...] | None, num_prompts: int | None, max_new_tokens: int | None,
              repeats: int | None, out_dir: str, as_json: bool, device: str | None, dtype: str | None,
              quick: bool) -> None:
    from specbatch.bench.job import JobBenchOptions, markdown, public, run_job_bench, write_files
    from specbatch.engine import Engine
    from specbatch.engine.loading import load_model
    from specbatch.errors import IntakeError
    from specbatch.jobs import intake

    if len(drafts) > 1:
        raise click.BadParameter("job mode takes one draft", param_hint="--draft")
    for name, value in (("--num-prompts", num_prompts), ("--max-new-tokens", max_new_tokens),
                        ("--repeats", repeats)):
        if value is not None and value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    given: dict[str, Any] = {
        "file": file, "target": target or settings.default_target,
        "draft": drafts[0] if drafts else settings.default_draft, "batch_sizes": sizes,
        "max_new_tokens": max_new_tokens, "num_prompts": num_prompts, "repeats": repeats,
        "device": device or settings.device, "dtype": dtype or settings.dtype,
        "cache_dir": settings.cache_dir or None}
    opts = JobBenchOptions.quick_defaults(**given) if quick else \
        JobBenchOptions(**{k: v for k, v in given.items() if v is not None})
    try:
        parsed = intake.parse_file(file, None, settings)
    except IntakeError as e:
        raise click.ClickException(str(e)) from e
    kw = {"device": opts.device, "dtype": opts.dtype, "cache_dir": opts.cache_dir}
    tgt, drf = load_model(opts.target, **kw), load_model(opts.draft, **kw)
    enc = Engine(tgt)
    requests = [(enc.encode(p.prompt, p.messages), p.generation_params().max_new_tokens) for p in parsed]

    def say(what: str, done: int, total: int) -> None:
        if not as_json:
            click.echo(f"[{done}/{total}] {what}", err=True)

    result = run_job_bench(opts, tgt, drf, requests, say)
    command = "specbatch " + shlex.join(sys.argv[1:]) if Path(sys.argv[0]).name == "specbatch" else None
    files = write_files(result, Path(out_dir), command)
    if as_json:
        echo_json(public(result))
    else:
        click.echo(markdown(result, command))
        click.echo(f"wrote {', '.join(files.values())}", err=True)
    bad_ours = [r["name"] for r in result["job"] if not r["identical"] and r["kind"] == "ours"]
    for r in result["job"]:
        if not r["identical"] and r["kind"] != "ours":
            warn(f"{r['name']} differs from the target alone on prompts {r['mismatched_prompts'][:5]}")
    if bad_ours:
        click.secho(f"FAILED: {', '.join(bad_ours)} differ from the target alone", err=True, fg="red")
        sys.exit(1)
