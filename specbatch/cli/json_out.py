"""--json output: the command's one JSON document on stdout, and a failure as JSON too.

The CLI's edge (``main.LazyGroup``) notes whether --json was given before the command parses its
options and, when the command fails, calls ``echo_json_error``: a script that asked for JSON gets
JSON whatever the outcome, with the same exit status and the same line on stderr. Kept free of
heavy imports: main imports it for every command, ``--help`` included.
"""

from __future__ import annotations

import json
from typing import Any

import click

from specbatch.redact import mask

# click context meta keys (shared by a command's context and its parent's)
JSON_ASKED = "specbatch.json_asked"    # --json was on the command line (set before parsing)
JSON_SENT = "specbatch.json_sent"      # the command printed its JSON document


def echo_json(data: Any) -> None:
    """Machine output for ``--json``: one JSON document on stdout."""
    click.echo(json.dumps(data, indent=2, default=str))
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[JSON_SENT] = True


def echo_json_error(ctx: click.Context, error: click.ClickException, cause: BaseException) -> None:
    """With --json, a failure is a JSON document on stdout too, unless the command already printed
    its own (``submit --wait``'s summary): ``{"error": {"message", "exit_code", "errors": [{"file",
    "line", "field", "message"}], "total"}}``. ``errors`` lists each problem of a prompt file or an
    option (empty for other failures); ``total`` counts them all (intake keeps the first 1,000).
    The exit status and the line on stderr stay as they are. ``error``: what the CLI's edge prints;
    ``cause``: what was raised."""
    from specbatch.errors import InputError, IntakeError

    if not ctx.meta.get(JSON_ASKED) or ctx.meta.get(JSON_SENT):
        return
    problems: list[dict[str, Any]] = []
    total = 0
    message = error.format_message()
    if isinstance(cause, IntakeError | InputError):
        found = cause.errors if isinstance(cause, IntakeError) else [cause]
        total = cause.total if isinstance(cause, IntakeError) else 1
        problems = [{"file": e.path, "line": e.line_no, "field": e.field, "message": mask(e.reason)} for e in found]
        message = message.split("\n")[0].removesuffix(":")    # the list is ``errors``
    elif isinstance(cause, click.BadParameter) and cause.param is not None:
        p = cause.param
        field = p.opts[0] if isinstance(p, click.Option) and p.opts else p.human_readable_name
        problems, total = [{"file": None, "line": None, "field": field, "message": message}], 1
    echo_json({"error": {"message": message, "exit_code": error.exit_code, "errors": problems, "total": total}})
