"""Single-prompt commands: generate (one prompt, speculative), models (what can be loaded)."""

from __future__ import annotations

import click

from specbatch.cli.common import (
    GAMMA,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    check_pair_device,
    compile_option,
    loading_models,
    nonempty_stops,
)
from specbatch.cli.compile_text import compiling_notice, report_compile, use_compile_cache
from specbatch.cli.json_out import echo_json
from specbatch.cli.throughput import device_options, no_draft, threads_option
from specbatch.config import get_settings
from specbatch.plural import plural


@click.command()
@click.option("--target", metavar="MODEL", help="Target model: known name, directory, .gguf file or HF id.")
@click.option("--draft", "drafts", multiple=True, metavar="DRAFTER",
              help="Drafter: a draft model (name, directory, .gguf file, HF id, or model:NAME) or ngram; "
                   "repeat for a pool; 'none': the target alone.")
@click.option("--ngram", is_flag=True, help="Add the prompt-lookup (n-gram) drafter to the pool (--draft ngram names it, "
                                                 "in place of the default draft).")
@click.option("--prompt", help="Prompt text, tokenized as is.")
@click.option("--message", "messages", multiple=True, metavar="TEXT",
              help="A user message (chat template applied); repeat for several turns.")
@click.option("--max-new-tokens", "--max-tokens", "max_new_tokens", type=click.IntRange(min=1), default=128,
              show_default=True, help="Tokens to generate at most (--max-tokens: OpenAI's name).")
@click.option("--gamma", type=GAMMA, default=None, help="Initial draft length (default 4).")
@click.option("--fixed-gamma", is_flag=True, help="Keep gamma fixed (no adaptation, no switch-off).")
@click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=TOP_P, default=1.0, show_default=True, help="Nucleus sampling mass, in (0, 1].")
@click.option("--top-k", type=TOP_K, default=0, show_default=True, help="Sample among the k likeliest; 0 is off.")
@click.option("--seed", type=SEED, default=None,
              help="Sampling seed (matters only with --temperature > 0): the same seed repeats the text.")
@click.option("--stop", multiple=True, callback=nonempty_stops,
              help="Stop string (repeatable); the text ends before it.")
@device_options
@compile_option
@threads_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(target, drafts, ngram, prompt, messages, max_new_tokens, gamma, fixed_gamma, temperature,
             top_p, top_k, seed, stop, device, dtype, compile_, threads, as_json) -> None:
    """Generate for one prompt with speculative decoding.

    \b
    Example:
      specbatch generate --prompt "Write a haiku about queues" --max-new-tokens 32 --json
      specbatch generate --target DIR --draft DIR2 --ngram --message "Hi" --temperature 0.7 --seed 1
    """
    from rich.console import Console

    from specbatch.cli.queue import resolve_pair
    from specbatch.engine import Engine, GenerationParams
    from specbatch.engine.threads import configure_threads

    settings = get_settings()
    if (prompt is None) == (not messages):
        raise click.UsageError("give exactly one of --prompt or --message")
    if no_draft(drafts, False):   # the target alone, as on run ('none' with other drafts: usage error)
        ngram = False
    target, drafts = resolve_pair(settings, target, drafts, ngram)
    check_pair_device(target, drafts, device or settings.device)
    configure_threads(threads or settings.threads or None, settings.local_workers)
    use_compile_cache(settings, compile_ or settings.compile)
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, stop=tuple(stop), gamma=gamma,
                              adaptive=not fixed_gamma).validate()
    with loading_models(Console(stderr=True), target, drafts):   # the first load: a minute or more
        engine = Engine.load(target, drafts,
                             device=device or settings.device, dtype=dtype or settings.dtype,
                             cache_dir=settings.cache_dir, compile=compile_ or settings.compile,
                             batch_size=1, expected_new_tokens=max_new_tokens,  # one prompt: one row
                             notify=compiling_notice, linears=settings.linears)
    report_compile(engine.compile_plan, say_eager=compile_ is not None)   # asked: auto says why
    msgs = [{"role": "user", "content": m} for m in messages] if messages else None
    out = engine.generate(prompt=prompt, messages=msgs, params=params)
    if as_json:
        echo_json(out.to_dict())
        return
    s = out.stats
    click.echo(out.text)
    # "acceptance 0.00" would read as every draft rejected where nothing was drafted (the gamma
    # controller found drafting does not pay here, or the n-gram drafter found no match)
    accepted = (f"acceptance {s.acceptance_rate:.2f}, {s.mean_acceptance_length:.2f} tokens/step"
                if s.drafted_tokens else "nothing drafted")
    click.echo(
        f"\n[{plural(s.new_tokens, 'token')}, {s.tokens_per_second:.1f} tok/s, finish={out.finish_reason}, "
        f"{accepted}, drafters {', '.join(engine.drafter_names) or 'none'}]", err=True)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def models(as_json: bool) -> None:
    """List the known model names and whether their weights are installed.

    \b
    Example:
      specbatch models
    """
    from rich.console import Console
    from rich.table import Table

    from specbatch.engine.loading import known_model_status

    rows = known_model_status()
    if as_json:
        echo_json(rows)
        return
    from rich.table import Column
    from rich.text import Text

    table = Table(Column("name", no_wrap=True), "installed", "description")
    for r in rows:      # Text: a "[...]" in a description is no markup tag
        table.add_row(Text(r["name"]), "yes" if r["installed"] else "no", Text(r["description"]))
    Console().print(table)
    # install commands are meant to be copied: plain lines after the table, never wrapped inside
    # a cell (a table column narrower than the command folds it mid-word)
    missing: dict[str, list[str]] = {}
    for r in rows:
        if not r["installed"]:
            missing.setdefault(r["install"], []).append(r["name"])
    for command, names in missing.items():
        click.echo(f"{', '.join(names)}: {command}")
