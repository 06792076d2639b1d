"""No secret in a log line: every log record of the gateway process is redacted as it is made.

uvicorn's access log writes each request's path with its query string (`/dashboard?key=<admin key>` went to the
log as it came), and any line may quote a URL or a value a client sent. So the process's log record factory
rewrites each record before any handler or filter sees it: the values of query parameters that name a secret
(key, api_key, token, password, ...) and every configured API key, wherever it appears, become [redacted]. A
record's arguments stay a tuple of the same length (uvicorn's access formatter unpacks them).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

REDACTED = "[redacted]"
SECRET_PARAM = re.compile(
    r"(?i)([?&;](?:api[_-]?key|key|access[_-]?token|token|secret|password|passwd|auth|"
    r"authorization)=)[^&;#\s\"']*"
)
_PLAIN = (int, float, bool, type(None))

_keys: list[str] = []  # configured keys, longest first (one inside another is redacted whole)
_installed = False
_formatter = logging.Formatter()


def install(keys: Iterable[str]) -> None:
    """Redact every record of this process from now on, with these keys among the secrets (idempotent: keys of
    later calls are added)."""
    global _installed
    _keys[:] = sorted({*_keys, *(k for k in keys if k)}, key=len, reverse=True)
    if _installed:
        return
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make(*args, **kwargs)
        redact_record(record)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


def redact(text: str) -> str:
    text = SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)
    for key in _keys:
        if key in text:
            text = text.replace(key, REDACTED)
    return text


def _arg(value):
    """An argument as the message will show it: unchanged unless its text holds a secret."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, _PLAIN):
        return value
    text = str(value)
    clean = redact(text)
    return value if clean == text else clean


def redact_record(record: logging.LogRecord) -> None:
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    if isinstance(record.args, tuple):
        record.args = tuple(_arg(a) for a in record.args)
    elif isinstance(record.args, Mapping):
        record.args = {k: _arg(v) for k, v in record.args.items()}
    if record.exc_info and record.exc_info[0] is not None:  # an exception's text may quote a URL too
        record.exc_text = redact(_formatter.formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
