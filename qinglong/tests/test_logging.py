"""The JSON formatter and the one redaction filter (docs/adr/0003: no secret in a log)."""

from __future__ import annotations

import io
import json
import logging
import secrets
from collections.abc import Iterator

import pytest
from django.conf import settings

from qinglong.logging import REDACTED, JsonFormatter, RedactionFilter, mask_secrets

CREDENTIAL = f"qlw_{secrets.token_urlsafe(32)}"
SESSION_TOKEN = f"qls_{secrets.token_urlsafe(32)}"
LEASE_TOKEN = secrets.token_urlsafe(32)


@pytest.fixture
def emitted() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactionFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("qinglong.tests.logging")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_formatter_writes_one_json_object_with_level_logger_message_and_extras(emitted):
    logger, stream = emitted
    logger.info("lease %s ended", 42, extra={"event": "lease_expired", "lease_id": 42})
    [record] = lines(stream)
    assert record["level"] == "INFO"
    assert record["logger"] == "qinglong.tests.logging"
    assert record["message"] == "lease 42 ended"
    assert record["event"] == "lease_expired"
    assert record["lease_id"] == 42
    assert str(record["ts"]).endswith("Z")


@pytest.mark.parametrize(
    "key",
    [
        "spec",
        "command",
        "env",
        "cwd",
        "token",
        "lease_token",
        "session_token",
        "credential",
        "authorization",
        "spec_sha256",
        "HTTP_AUTHORIZATION",
    ],
)
def test_sensitive_extra_keys_are_masked_whatever_their_value(emitted, key):
    logger, stream = emitted
    logger.warning("x", extra={key: {"command": ["rm", "-rf", "/"], "n": 1}})
    [record] = lines(stream)
    assert record[key] == REDACTED


def test_secrets_in_message_args_and_nested_extras_are_masked(emitted):
    logger, stream = emitted
    logger.error(
        "worker %s presented %s and lease %s",
        CREDENTIAL,
        SESSION_TOKEN,
        LEASE_TOKEN,
        extra={"detail": {"nested": [f"Bearer {SESSION_TOKEN}"], "ok": "plain"}},
    )
    text = stream.getvalue()
    for secret in (CREDENTIAL, SESSION_TOKEN, LEASE_TOKEN):
        assert secret not in text
    [record] = lines(stream)
    assert record["message"].count(REDACTED) == 3
    assert record["detail"]["ok"] == "plain"


def test_exception_text_is_masked(emitted):
    logger, stream = emitted
    try:
        raise ValueError(f"bad token {LEASE_TOKEN}")
    except ValueError:
        logger.exception("failed")
    [record] = lines(stream)
    assert "ValueError" in record["exc"]
    assert LEASE_TOKEN not in stream.getvalue()


def test_mask_leaves_ordinary_text_and_digests_alone():
    text = "lease 12 attempt 7 digest " + "ab" * 32
    assert mask_secrets(text) == text


def test_every_configured_handler_has_the_redaction_filter():
    handlers = settings.LOGGING["handlers"]
    assert handlers
    for handler in handlers.values():
        assert "redact" in handler["filters"]
    assert settings.LOGGING["filters"]["redact"]["()"] == "qinglong.logging.RedactionFilter"
