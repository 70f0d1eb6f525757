"""`specbatch bench`: ours against the baselines, same prompts, same run; tables, JSON and plots."""

from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

import click

from specbatch.cli.common import require_extra, warn
from specbatch.cli.compile_text import compile_notice
from specbatch.cli.json_out import echo_json
from specbatch.cli.throughput import device_options
from specbatch.config import get_settings

# what the bench extra installs (pyproject.toml): the default and job modes' PNG plots
BENCH_MODULES = ("matplotlib",)


def _ints(value: str | None, option: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated integers, e.g. 1,2,4", param_hint=option) from None
    if not out or any(x < 1 for x in out):
        raise click.BadParameter(f"{value!r}: give integers >= 1", param_hint=option)
    return out


@click.command()
@click.option("--target", default=None, help="Target model (default: the configured default target).")
@click.option("--draft", "drafts", multiple=True, help="Draft model; repeat for a pool (default: the configured draft).")
@click.option("--ngram/--no-ngram", default=True, show_default=True, help="Add the n-gram (prompt lookup) drafter.")
@click.option("--prompts", default="all", show_default=True,
              help="A JSONL file, 'all', or a comma list of bundled sets: code, chat, grounded.")
@click.option("--num-prompts", type=int, default=None, help="Prompts to use, round-robin across categories [12; quick 3].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="New tokens per prompt [128; quick 48].")
@click.option("--repeats", type=int, default=None, help="Interleaved repeats of every configuration [2].")
@click.option("--gamma-grid", default=None, help="Fixed draft lengths to measure [1,2,3,4,6,8; quick 2,4,6].")
@click.option("--hf-settings", default=None,
              help="HF assisted settings to run: default,const3,const5,heuristic5, and compiled5 (const5 through "
                   "HF's static cache + torch.compile; minutes of compiling) [default,const3,const5,heuristic5; "
                   "quick default,const5].")
@click.option("--batch-sizes", default=None, help="Throughput mode: batch sizes, e.g. 1,4,8,16.")
@click.option("--throughput-prompts", type=int, default=32, show_default=True, help="Prompts in throughput mode.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-results", show_default=True,
              help="Directory for report.md, result.json and the PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the Markdown table.")
@device_options
@click.option("--random-weights", is_flag=True,
              help="Random-weight models of the same shapes (speed only); adds a self-draft for acceptance.")
@click.option("--threads", type=int, default=None,
              help="torch CPU threads (default: torch's choice); 1 helps on a busy shared machine.")
@click.option("--compile", "compile_", type=click.Choice(["auto", "on", "off"]), default="off", show_default=True,
              help="on: ours (and a target[compiled] reference) through the compiled forward, T(k) compiled vs "
                   "eager interleaved, compile time reported; auto: on when the compile cache holds it.")
@click.option("--llama-cpp/--no-llama-cpp", "llama_cpp", default=True, show_default=True,
              help="The llama.cpp baseline on the target's GGUF file (B=1, and each --batch-sizes B in one "
                   "llama_batch; in job mode llama-cpp[B=b] per batch size); skipped with the build line "
                   "where llama-cpp-python is not installed.")
@click.option("--quick", is_flag=True, help="A small subset: about 2-3 minutes on the default pair.")
@click.option("--telemetry", is_flag=True,
              help="Instead: the worker's chunk loop with tracing + metrics on vs off, interleaved "
                   "[6 prompts x 32 tokens, 3 repeats].")
@click.option("--job", "job_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Job mode: this whole prompt file end to end per configuration (ours-auto, ours at fixed "
                   "B with and without speculation, HF generate and llama.cpp at the same B, HF assisted "
                   "at B=1).")
@click.option("--structured", is_flag=True,
              help="Instead: a JSON-schema job, grammar drafting on vs off and vs plain constrained decoding, "
                   "at the autopilot's choice and at each --batch-sizes [auto,1,4,16; quick auto,1,8].")
@click.option("--shared-prefix", type=click.IntRange(min=16), default=None, metavar="TOKENS",
              help="Job mode on a generated file (written to --out): 48 chat requests sharing one system "
                   "prompt of about TOKENS tokens, a short question each, 32-64 new tokens; ours-auto with "
                   "the prefix cache vs without it, interleaved, and HF generate at --batch-sizes [8].")
@click.option("--breakdown/--no-breakdown", default=True, show_default=True,
              help="Job mode: one more ours-auto pass under the profiler (untimed), for where the time goes "
                   "and the share of the GEMM peak.")
@click.option("--no-prefix-cache", is_flag=True,
              help="Job mode: ours prefills every prompt whole (no shared prefixes computed once).")
def bench(target, drafts, ngram, prompts, num_prompts, max_new_tokens, repeats, gamma_grid, hf_settings, batch_sizes,
          throughput_prompts, out_dir, as_json, device, dtype, random_weights, threads, quick, telemetry, compile_,
          job_file, structured, shared_prefix, no_prefix_cache, llama_cpp, breakdown) -> None:
    """Benchmark speculative decoding against the target alone and Hugging Face assisted generation.

    \b
    Example:
      specbatch bench --quick --threads 1 --out bench-results
      specbatch bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b-int8 --ngram --batch-sizes 1,4,8,16
      specbatch bench --job examples/prompts.jsonl --quick --threads 1
      specbatch bench --structured --quick --threads 1
      specbatch bench --shared-prefix 600 --threads 1
    """
    from specbatch.bench.harness import BenchOptions, run_bench
    from specbatch.bench.report import markdown, write_all
    from specbatch.bench.runners import HF_ASSISTED_SETTINGS

    if threads is not None:
        if threads < 1:
            raise click.BadParameter("must be >= 1", param_hint="--threads")
        import torch

        torch.set_num_threads(threads)
    settings = get_settings()
    if telemetry:
        return _telemetry(settings, target, drafts, ngram, prompts, num_prompts, max_new_tokens, repeats,
                          device, dtype, as_json)
    if structured:
        if len(drafts) > 1:
            raise click.BadParameter("--structured takes one draft", param_hint="--draft")
        return _structured(settings, target, drafts, _ints(batch_sizes, "--batch-sizes"), num_prompts,
                           max_new_tokens, repeats, device, dtype, quick, out_dir, as_json)
    # the plots are drawn last: a missing matplotlib failed only after minutes of measuring
    require_extra("bench", BENCH_MODULES, "specbatch bench (its plots)")
    if shared_prefix is not None and (job_file is not None or no_prefix_cache):
        raise click.UsageError("--shared-prefix generates its own file and runs the prefix cache on and off: "
                               "drop --job / --no-prefix-cache")
    if job_file is not None or shared_prefix is not None:
        from specbatch.cli.bench_job import bench_job

        bench_job(settings, job_file, target, drafts, _ints(batch_sizes, "--batch-sizes"), num_prompts,
                  max_new_tokens, repeats, out_dir, as_json, device, dtype, quick,
                  shared_prefix=shared_prefix, prefix_cache=not no_prefix_cache, llama_cpp=llama_cpp,
                  breakdown=breakdown)
        return
    if no_prefix_cache:
        raise click.UsageError("--no-prefix-cache is for job mode (--job FILE): the other modes' prompts "
                               "share no prefix")
    given = {
        "target": target or settings.default_target,
        "drafts": tuple(drafts) if drafts else (settings.default_draft,),
        "ngram": ngram, "prompts": prompts, "device": device or settings.device,
        "dtype": dtype or settings.dtype, "cache_dir": settings.cache_dir or None, "linears": settings.linears,
        "random_weights": random_weights, "throughput_prompts": throughput_prompts,
        "batch_sizes": _ints(batch_sizes, "--batch-sizes") or (),
        "compile": compile_, "llama_cpp": llama_cpp,
    }
    for key, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens),
                       ("repeats", repeats), ("gamma_grid", _ints(gamma_grid, "--gamma-grid"))):
        if value is not None:
            if isinstance(value, int) and value < 1:
                raise click.BadParameter("must be >= 1", param_hint=f"--{key.replace('_', '-')}")
            given[key] = value
    if hf_settings is not None:
        names = tuple(x.strip() for x in hf_settings.split(",") if x.strip())
        unknown = [x for x in names if x not in HF_ASSISTED_SETTINGS]
        if unknown:
            raise click.BadParameter(f"unknown setting(s) {', '.join(unknown)}; choose from "
                                     f"{', '.join(HF_ASSISTED_SETTINGS)}", param_hint="--hf-settings")
        given["hf_settings"] = names
    opts = BenchOptions.quick_defaults(**given) if quick else BenchOptions(**given)

    result = _run_with_progress(functools.partial(run_bench, notify=compile_notice), opts, quiet=as_json)
    command = "specbatch " + shlex.join(sys.argv[1:]) if Path(sys.argv[0]).name == "specbatch" else None
    result["command"] = command
    files = write_all(result, Path(out_dir), command)
    result["files"] = files
    if as_json:
        echo_json(result)
    else:
        click.echo(markdown(result, command))
        click.echo(f"wrote {', '.join(files.values())}", err=True)
    for w in result["warnings"]:
        warn(w)
    llama = result.get("llama_cpp") or {}
    if llama.get("status") == "skipped":
        warn(f"llama.cpp baseline skipped: {llama['reason']}")
    if result["failures"]:
        for f in result["failures"]:
            click.secho(f"FAILED: {f}", err=True, fg="red")
        sys.exit(1)


def _run_with_progress(run, opts, quiet: bool):  # type: ignore[no-untyped-def]
    """Run with a progress bar on stderr (a terminal only; silent under --json pipes)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        if quiet:
            return run(opts)
        last: list[str] = [""]

        def log(what: str, done: int, total: int) -> None:  # one line per stage, for logs
            stage = what.split(" prompt ")[0]
            if stage != last[0]:
                last[0] = stage
                click.echo(f"[{done}/{total}] {stage}", err=True)

        return run(opts, log)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def update(what: str, done: int, total: int) -> None:
            bar.update(task, description=what[:80], completed=done, total=max(total, 1))

        return run(opts, update)


def _telemetry(settings, target, drafts, ngram, prompts, num_prompts, max_new_tokens, repeats, device, dtype,
               as_json) -> None:  # type: ignore[no-untyped-def]
    from specbatch.bench.telemetry import TelemetryOptions, markdown, run_telemetry_cost

    given = {"target": target or settings.default_target,
             "drafts": tuple(drafts) if drafts else (settings.default_draft,), "ngram": ngram,
             "prompts": prompts, "device": device or settings.device, "dtype": dtype or settings.dtype,
             "cache_dir": settings.cache_dir or None, "linears": settings.linears}
    for key, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens), ("repeats", repeats)):
        if value is not None:
            if value < 1:
                raise click.BadParameter("must be >= 1", param_hint=f"--{key.replace('_', '-')}")
            given[key] = value
    result = _run_with_progress(run_telemetry_cost, TelemetryOptions(**given), quiet=as_json)
    command = "specbatch " + shlex.join(sys.argv[1:]) if Path(sys.argv[0]).name == "specbatch" else None
    result["command"] = command
    if as_json:
        echo_json(result)
    else:
        click.echo(markdown(result, command))


def _structured(settings, target, drafts, sizes, num_prompts, max_new_tokens, repeats, device, dtype, quick,
                out_dir, as_json) -> None:  # type: ignore[no-untyped-def]
    import json

    from specbatch.bench.structured import StructuredBenchOptions, markdown, run_structured_bench
    from specbatch.engine.loading import load_model

    for name, value in (("--num-prompts", num_prompts), ("--max-new-tokens", max_new_tokens),
                        ("--repeats", repeats)):
        if value is not None and value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    given = {"target": target or settings.default_target, "draft": drafts[0] if drafts else settings.default_draft,
             "batch_sizes": ("auto", *sizes) if sizes else None, "num_prompts": num_prompts,
             "max_new_tokens": max_new_tokens, "repeats": repeats}
    opts = StructuredBenchOptions.quick_defaults(**given) if quick else \
        StructuredBenchOptions(**{k: v for k, v in given.items() if v is not None})
    kw = {"device": device or settings.device, "dtype": dtype or settings.dtype,
          "cache_dir": settings.cache_dir or None, "linears": settings.linears}
    tgt = load_model(opts.target, **kw)
    drf = load_model(opts.draft, **kw, loaded=[tgt])
    result = _run_with_progress(lambda o, say=None: run_structured_bench(o, tgt, drf, say), opts, quiet=as_json)
    command = "specbatch " + shlex.join(sys.argv[1:]) if Path(sys.argv[0]).name == "specbatch" else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured-report.md").write_text(markdown(result, command), encoding="utf-8")
    (out / "structured-result.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    if as_json:
        echo_json(result)
    else:
        click.echo(markdown(result, command))
    bad = [r["name"] for r in result["rows"] if not r["identical"]]
    if bad:
        click.secho(f"FAILED: {', '.join(bad)} differ from the target alone", err=True, fg="red")
        sys.exit(1)
