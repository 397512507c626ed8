"""Structured JSON logs with one redaction filter every record passes through.

docs/adr/0003: nothing secret (command, env, cwd, lease/session tokens, Worker
credentials) may reach a log. The services already log only ids and counts;
this filter is the second line of defence for whatever slips through — an
exception message, a third-party logger, an `extra` someone adds later. It is
attached to every handler in `settings.LOGGING`, so no record is formatted
without passing through it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import traceback
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

__all__ = ["REDACTED", "JsonFormatter", "RedactionFilter", "mask_secrets", "redact_value"]

REDACTED: Final = "[redacted]"

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS: Final = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "taskName"}
)

# Key names whose values are (or carry) secrets or the ExecutionSpec. A key is
# sensitive when any of its `_`/`-`-separated words is one of these, so
# `lease_token`, `session_token`, `spec_sha256` and `http_authorization` match.
_SENSITIVE_WORDS: Final = frozenset(
    {
        "spec",
        "command",
        "cmd",
        "argv",
        "env",
        "environ",
        "cwd",
        "token",
        "credential",
        "credentials",
        "authorization",
        "secret",
        "password",
        "cookie",
    }
)

# Our secrets: Worker credentials (qlw_…), Session tokens (qls_…) and bare
# 256-bit base64url tokens (secrets.token_urlsafe(32) is 43 characters), which
# is what lease tokens and the random part of the other two look like.
_SECRET_PATTERN: Final = re.compile(
    r"\bql[ws]_[A-Za-z0-9_\-]+"
    r"|(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]{43}(?![A-Za-z0-9_\-])"
    r"|(?i:bearer)\s+\S+"
)
_MAX_DEPTH: Final = 6
# Ids, counts and flags, the usual `extra` values: returned before any other check.
_PLAIN: Final = frozenset({int, bool, float})


_KEY_WORDS: Final = re.compile(r"[_\-.\s]+")


# Remembered: every record asks it of the same few `extra` names (a lease ACK
# line of four; issue #12, bench/request_cost.py). Bounded, as keys of a
# logged mapping may come from anywhere.
@functools.lru_cache(maxsize=1024)
def is_sensitive_key(key: str) -> bool:
    return not _SENSITIVE_WORDS.isdisjoint(_KEY_WORDS.split(key.lower()))


def mask_secrets(text: str) -> str:
    """Replace anything that looks like one of our secrets."""
    return _SECRET_PATTERN.sub(REDACTED, text)


def redact_value(value: object, depth: int = 0) -> object:
    """Mask secret-looking strings and sensitive keys, recursively (bounded)."""
    if value is None or type(value) in _PLAIN:
        return value
    if depth > _MAX_DEPTH:
        return REDACTED
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, bytes | bytearray):
        return mask_secrets(bytes(value).decode("utf-8", "replace"))
    if isinstance(value, Mapping):
        return {
            str(key): REDACTED if is_sensitive_key(str(key)) else redact_value(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [redact_value(item, depth + 1) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    # Arbitrary objects may render their secrets in str(); mask the rendering.
    return mask_secrets(str(value))


class RedactionFilter(logging.Filter):
    """Masks sensitive `extra` keys and secret-looking text; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Render the message once with its args, mask it, and freeze it: a
        # handler formatting later must not re-interpolate unmasked args.
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001  (a bad format string must not lose the record)
            message = f"{record.msg!s} (unformattable args)"
        record.msg = mask_secrets(message)
        record.args = None
        for key in vars(record).keys() - _STANDARD_ATTRS:
            value = getattr(record, key)
            setattr(record, key, REDACTED if is_sensitive_key(key) else redact_value(value))
        if record.exc_info and record.exc_info[1] is not None:
            # Exception messages can quote what they failed on: render and mask
            # now, and drop exc_info so no formatter renders it unmasked.
            record.exc_text = mask_secrets("".join(traceback.format_exception(*record.exc_info)))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = mask_secrets(record.exc_text)
        if record.stack_info:
            record.stack_info = mask_secrets(record.stack_info)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            payload["exc"] = record.exc_text
        if record.stack_info:
            payload["stack"] = record.stack_info
        return json.dumps(payload, default=str, ensure_ascii=False, separators=(",", ":"))
