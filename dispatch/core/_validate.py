"""Low-level field checks shared by `spec` and `placement`.

Kept apart so `placement` (needed by `spec.TaskDefinition`) and `spec` (which owns
the executor-type rule) do not import each other. Every failure is a `SpecError`
(or the subclass the caller asks for) naming the field, never the value.
"""

from __future__ import annotations

import re
from typing import Final

from dispatch.core.errors import SpecError

EXECUTOR_TYPE_RE: Final = r"^[a-z][a-z0-9_.-]{0,31}$"
_EXECUTOR_TYPE = re.compile(EXECUTOR_TYPE_RE)


def require_str(
    value: object,
    *,
    field: str,
    max_chars: int,
    allow_empty: bool = True,
    error: type[SpecError] = SpecError,
) -> str:
    if not isinstance(value, str):
        raise error(field, "must be a string")
    if not allow_empty and not value:
        raise error(field, "must not be empty")
    if len(value) > max_chars:
        raise error(field, f"must be at most {max_chars} characters")
    # NUL truncates strings in C APIs (exec, PostgreSQL text): a definition that
    # carries one would not run what the operator saw.
    if "\x00" in value:
        raise error(field, "must not contain NUL characters")
    # A lone surrogate has no UTF-8 form: the canonical JSON (and so the spec
    # digest) could never be computed, and PostgreSQL's jsonb rejects it.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise error(field, "must be valid Unicode text") from None
    return value


def require_int(
    value: object,
    *,
    field: str,
    minimum: int,
    maximum: int,
    error: type[SpecError] = SpecError,
) -> int:
    # bool is an int subclass; `True` where a count is expected is always a bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(field, "must be an integer")
    if not minimum <= value <= maximum:
        raise error(field, f"must be between {minimum} and {maximum}")
    return int(value)


def validate_executor_type(
    value: object, *, field: str = "executor_type", error: type[SpecError] = SpecError
) -> str:
    text = require_str(value, field=field, max_chars=32, allow_empty=False, error=error)
    if _EXECUTOR_TYPE.fullmatch(text) is None:
        raise error(field, "must match ^[a-z][a-z0-9_.-]{0,31}$")
    return text
