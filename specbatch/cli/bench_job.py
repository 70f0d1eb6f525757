"""`specbatch bench --job FILE`: load the pair, read the file, run ``specbatch.bench.job``, report."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from specbatch.cli.common import warn
from specbatch.cli.json_out import echo_json
from specbatch.config import Settings


def bench_job(settings: Settings, file: str | None, target: str | None, drafts: tuple[str, ...],
              sizes: tuple[int, ...] | None, num_prompts: int | None, max_new_tokens: int | None,
              repeats: int | None, out_dir: str, as_json: bool, device: str | None, dtype: str | None,
              quick: bool, *, shared_prefix: int | None = None, prefix_cache: bool = True,
              llama_cpp: bool = True, breakdown: bool = True) -> None:
    """``file`` None: ``shared_prefix`` tokens, a generated file (specbatch/bench/shared_prefix.py)."""
    from specbatch.bench import shared_prefix as sp
    from specbatch.bench.job import (
        SHARED_PREFIX_SIZES,
        JobBenchOptions,
        job_requests,
        markdown,
        public,
        run_job_bench,
        write_files,
    )
    from specbatch.engine.loading import load_model
    from specbatch.errors import IntakeError
    from specbatch.jobs import intake

    if len(drafts) > 1:
        raise click.BadParameter("job mode takes one draft", param_hint="--draft")
    for name, value in (("--num-prompts", num_prompts), ("--max-new-tokens", max_new_tokens),
                        ("--repeats", repeats)):
        if value is not None and value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    kw: dict[str, Any] = {"device": device or settings.device, "dtype": dtype or settings.dtype,
                          "cache_dir": settings.cache_dir or None, "linears": settings.linears}
    tgt = None
    if file is None:        # (a file given is read before any model loads: a bad one costs nothing)
        assert shared_prefix is not None
        tgt = load_model(target or settings.default_target, **kw)
        file = str(sp.write(Path(out_dir) / f"shared-prefix-{shared_prefix}.jsonl",
                            sp.requests(tgt.tokenizer, shared_prefix)))
        sizes = sizes or SHARED_PREFIX_SIZES
    given: dict[str, Any] = {
        "file": file, "target": target or settings.default_target,
        "draft": drafts[0] if drafts else settings.default_draft, "batch_sizes": sizes,
        "max_new_tokens": max_new_tokens, "num_prompts": num_prompts, "repeats": repeats,
        "device": device or settings.device, "dtype": dtype or settings.dtype,
        "cache_dir": settings.cache_dir or None, "shared_prefix": shared_prefix, "prefix_cache": prefix_cache,
        "llama_cpp": llama_cpp, "breakdown": breakdown}
    opts = JobBenchOptions.quick_defaults(**given) if quick else \
        JobBenchOptions(**{k: v for k, v in given.items() if v is not None})
    try:
        parsed = intake.parse_file(file, None, settings)
    except IntakeError as e:
        raise click.ClickException(str(e)) from e
    tgt = tgt or load_model(opts.target, **kw)
    drf = load_model(opts.draft, **kw, loaded=[tgt])
    requests = job_requests(parsed, tgt)

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
    if result.get("prefix_cache") is not None and not result["prefix_cache"]["identical"]:
        bad_ours.append("ours-auto with the prefix cache against without it")
    # llama.cpp's differences are its numerics (Q4_1 vs fp32): counted in its paragraph, not warned of
    for r in result["job"]:
        if not r["identical"] and r["kind"] not in ("ours", "llama-cpp"):
            warn(f"{r['name']} differs from the target alone on prompts {r['mismatched_prompts'][:5]}")
    llama = result.get("llama_cpp") or {}
    if llama.get("status") == "skipped":
        warn(f"llama.cpp baseline skipped: {llama['reason']}")
    for name, errors in (llama.get("errors") or {}).items():
        warn(f"{name}: {'; '.join(errors)}")
    if bad_ours:
        click.secho(f"FAILED: {', '.join(bad_ours)} differ from the target alone", err=True, fg="red")
        sys.exit(1)
