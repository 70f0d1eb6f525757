"""Credentials out of everything a person or a log sees: the one masking helper.

``mask(text)`` finds every ``scheme://...`` URL inside ``text`` and masks its secrets, wherever the
URL keeps them: the password of its userinfo (``user:***@host``) and the values of its secret query
parameters (``?password=***``, which libpq and Redis accept as well). Every message that may carry a
setting goes through it: CLI output and errors, log lines (``RedactingFilter``), the worker's refusal
lines, the Celery/Flower-visible configuration.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote

MASK = "***"
# query parameters that carry a secret (libpq: password, sslpassword; Redis/kombu: password;
# tokens of any service); compared lower-case, after percent-decoding the name
SECRET_PARAMS = frozenset({"password", "pass", "passwd", "pwd", "sslpassword", "token", "access_token",
                           "secret", "api_key", "apikey"})
# a URL runs from its scheme to the first space or quote (a URL quoted in a message ends there)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def _mask_userinfo(authority_and_path: str) -> str:
    # the userinfo ends at the last "@" before the query (an unencoded "@" or "/" in a password
    # still ends up masked; a path with ":...@" in it is masked too, the safe side); "user:pw" keeps
    # the user, a bare "user@" has no password
    if "@" not in authority_and_path:
        return authority_and_path
    userinfo, _, rest = authority_and_path.rpartition("@")
    if userinfo.startswith("/"):       # a path with an "@" in it (sqlite:////tmp/a@b.db), no userinfo
        return authority_and_path
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}@{rest}" if colon else authority_and_path


# a value masked before, then the sentence's punctuation that the URL match took along (a message
# holding a masked URL is masked again at the CLI's edge: "...?password=***: connection failed")
_MASKED_THEN_PUNCTUATION = re.compile(re.escape(MASK) + r"[:,.;)\]}!?]+")


def _mask_query(query: str) -> str:
    parts = []
    for part in re.split(r"([&;])", query):
        name, eq, value = part.partition("=")
        secret = eq and unquote(name).strip().lower() in SECRET_PARAMS
        parts.append(part if not secret or _MASKED_THEN_PUNCTUATION.fullmatch(value) else f"{name}={MASK}")
    return "".join(parts)


def mask_url(url: str) -> str:
    """``url`` with its userinfo password and secret query parameters replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, q, query = rest.partition("?")
    return f"{scheme}://{_mask_userinfo(head)}{q}{_mask_query(query) if q else ''}"


def mask(text: str) -> str:
    """``text`` with the secrets of every URL in it replaced by ``***`` (see ``mask_url``)."""
    return _URL.sub(lambda m: mask_url(m.group(0)), text)


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
