"""Webhook signing: `X-Qinglong-Signature: t=<unix seconds>,v1=<hex>` (README "Webhooks").

v1 = HMAC-SHA256(secret, "<t>.<body>") in lowercase hex, where body is the
exact bytes of the request body. A receiver recomputes it with its secret,
compares in constant time and refuses a `t` too far from its clock (replay);
`signature_verify` is that check, for receivers written in Python and for the
tests.

The secret of a subscription is derived, never stored: HMAC-SHA256 of the
subscription's id and random nonce under `QINGLONG_WEBHOOK_SECRET` (like the
lease tokens of global claims, docs/adr/0003). Rotating it is a new nonce.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Final

from django.conf import settings

__all__ = [
    "SIGNATURE_HEADER",
    "SIGNATURE_TOLERANCE_S",
    "new_secret_nonce",
    "signature_header",
    "signature_verify",
    "subscription_secret",
]

SIGNATURE_HEADER: Final = "X-Qinglong-Signature"
# How far a receiver should accept `t` from its own clock.
SIGNATURE_TOLERANCE_S: Final = 300
_SECRET_PREFIX: Final = "whsec_"


def new_secret_nonce() -> str:
    return secrets.token_hex(16)


def subscription_secret(*, subscription_id: int, nonce: str) -> str:
    """The signing secret of one subscription (shown once to the operator)."""
    key = str(settings.QINGLONG_WEBHOOK_SECRET).encode()
    message = f"qinglong-webhook-v1\x00{subscription_id}\x00{nonce}".encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return _SECRET_PREFIX + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _v1(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), b"%d." % timestamp + body, hashlib.sha256).hexdigest()


def signature_header(*, secret: str, body: bytes, timestamp: int | None = None) -> str:
    ts = int(time.time()) if timestamp is None else timestamp
    return f"t={ts},v1={_v1(secret, ts, body)}"


def signature_verify(
    *,
    secret: str,
    header: str,
    body: bytes,
    now: float | None = None,
    tolerance_s: int = SIGNATURE_TOLERANCE_S,
) -> bool:
    """A receiver's check: a v1 signature matches and `t` is within the tolerance."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(key, []).append(value)
    stamps = fields.get("t", [])
    if len(stamps) != 1 or not stamps[0].isascii() or not stamps[0].isdigit():
        return False
    timestamp = int(stamps[0])
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = _v1(secret, timestamp, body)
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))
