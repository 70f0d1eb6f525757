"""specbatch audit: the certificate that a finished job's output is its target's output."""

from __future__ import annotations

from typing import Any

import click

from specbatch.cli.common import open_db
from specbatch.cli.json_out import echo_json
from specbatch.cli.throughput import device_options
from specbatch.config import get_settings
from specbatch.plural import plural


@click.command()
@click.argument("job_id", metavar="JOB")
@click.option("--sample", metavar="N|PCT%", help="Audit N completed requests, or PCT% of them (default: all).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which requests --sample picks.")
@device_options
@click.option("--json", "as_json", is_flag=True, help="Print {id, audited, passed, failed, requests} as JSON.")
def audit(job_id: str, sample: str | None, seed: int, device: str | None, dtype: str | None,
          as_json: bool) -> None:
    """Re-decode a finished job's requests with the target alone and compare (exit 0: all match;
    1: one does not, or nothing completed to audit).

    Greedy and seeded requests must be token-identical to the target decoding alone; unseeded
    sampled requests' stored logprobs must equal the target's (without stored logprobs: every
    token must be one the target could sample). Speculation is lossless when this passes.

    \b
    Example:
      specbatch audit 3f9a2c --sample 10%
    """
    from specbatch.engine import Engine
    from specbatch.jobs import audit as auditor
    from specbatch.jobs import store

    settings = get_settings()
    fraction = auditor.parse_sample(sample)
    with open_db(settings, readonly=True).begin() as s:
        jid = store.get_job(s, job_id).id
        items = auditor.items(s, jid, fraction, seed)
    device, dtype = _as_decoded(auditor.decoded_on(items), device, dtype, settings.device, settings.dtype)
    engines: dict[str, Engine] = {}

    def engine_for(target: str) -> Engine:
        if target not in engines:      # the target alone: no drafts, no n-gram drafter
            engines[target] = Engine.load(target, device=device, dtype=dtype, cache_dir=settings.cache_dir,
                                          batch_size=1, linears=settings.linears)
        return engines[target]

    def show(v: Any) -> None:
        if not as_json:
            sample = f" sample {v.sample_index}" if v.sample_index else ""
            click.echo(f"{'ok  ' if v.ok else 'FAIL'} {v.custom_id}{sample}: {v.check}: {v.detail}")

    verdicts = auditor.audit(items, engine_for, show)
    failed = [v for v in verdicts if not v.ok]
    if as_json:
        echo_json({"id": jid, "audited": len(verdicts), "passed": len(verdicts) - len(failed),
                   "failed": len(failed), "requests": [v.to_dict() for v in verdicts]})
    else:
        # a support check (sampled, no seed, no logprobs stored) is weaker than a match: say how many
        weak = sum(v.ok and v.check == "support" for v in verdicts)
        exact = len(verdicts) - len(failed) - weak
        # (a request with n samples is n results: each sample is audited)
        what = "result" if any(v.sample_index for v in verdicts) else "request"
        click.echo(f"{plural(len(verdicts), what)} audited: {exact} match the target alone"
                   + (f", {weak} sampled without a seed or stored logprobs only possible under it "
                      "(a seed re-decodes a sample exactly)" if weak else "")
                   + f", {len(failed)} do not", err=True)
    if not verdicts:   # an audit of nothing certifies nothing: not a pass
        click.echo(f"specbatch: nothing to audit: job {jid} has no completed request "
                   f"(`specbatch status {jid}` says where its requests are)", err=True)
    if failed or not verdicts:
        raise SystemExit(1)


def _as_decoded(decoded: tuple[str | None, str | None], device: str | None, dtype: str | None,
                default_device: str, default_dtype: str) -> tuple[str, str]:
    """The device and dtype to re-decode with: --device / --dtype where given, else the ones the
    results were decoded with (``audit.decoded_on``) where this machine has that device, else the
    settings'. The configured device keeps its index where it is of the recorded type (cuda:1)."""
    from specbatch.engine.loading import parse_device, resolve_device
    from specbatch.errors import DeviceError

    recorded_device, recorded_dtype = decoded
    if device is None:
        device = default_device
        try:
            configured = parse_device(default_device).type
        except ValueError:      # SPECBATCH_DEVICE's mistake: the load says it in one line
            configured = recorded_device
        if recorded_device is not None and configured != recorded_device:
            try:
                resolve_device(recorded_device)     # (DeviceError: not on this machine)
                device = recorded_device
            except DeviceError:
                click.echo(f"specbatch: the results were decoded on {recorded_device}, which this machine does "
                           f"not have: auditing on {device}, where a near-tie may round the other way", err=True)
    return device, dtype or recorded_dtype or default_dtype
