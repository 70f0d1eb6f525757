"""Credentials out of everything a person or a log sees: the one masking helper.

``mask(text)`` replaces the password of every ``scheme://user:password@host`` URL inside ``text``
with ``***``. Every message that may carry a setting goes through it: CLI output and errors,
log lines (``RedactingFilter``), the Celery/Flower-visible configuration.
"""

from __future__ import annotations

import logging
import re

MASK = "***"
# scheme://[user]:password@  (the password may be empty-looking but not contain '@' or spaces)
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s'\"]*):(?P<pw>[^@\s'\"/]+)@")


def mask(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _CREDENTIALS.sub(lambda m: f"{m.group('head')}:{MASK}@", text)


class RedactingFilter(logging.Filter):
    """A handler filter that masks credentials in the formatted message of every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's business, not ours
            return True
        masked = mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None:
            text = mask(logging.Formatter().formatException(record.exc_info))
            record.exc_info, record.exc_text = None, text
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add ``RedactingFilter`` to every handler of ``logger`` (default: the root logger)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
