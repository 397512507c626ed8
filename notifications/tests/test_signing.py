"""X-Qinglong-Signature: t=<ts>,v1=HMAC-SHA256(secret, "<ts>.<body>") (README "Webhooks")."""

from __future__ import annotations

import hashlib
import hmac

from django.test import override_settings

from notifications.signing import signature_header, signature_verify, subscription_secret

BODY = b'{"event":"run.failed"}'


def test_the_header_is_hmac_sha256_over_timestamp_dot_body():
    header = signature_header(secret="whsec_x", body=BODY, timestamp=1700000000)
    expected = hmac.new(b"whsec_x", b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_verify_accepts_the_right_secret_within_the_tolerance_only():
    header = signature_header(secret="whsec_x", body=BODY, timestamp=1700000000)
    assert signature_verify(secret="whsec_x", header=header, body=BODY, now=1700000100)
    assert not signature_verify(secret="whsec_y", header=header, body=BODY, now=1700000100)
    assert not signature_verify(secret="whsec_x", header=header, body=BODY + b" ", now=1700000100)
    # A replay long after: refused.
    assert not signature_verify(secret="whsec_x", header=header, body=BODY, now=1700001000)
    for broken in ("", "t=abc,v1=00", "v1=00", "t=1700000000", "t=1700000000,t=1,v1=00"):
        assert not signature_verify(secret="whsec_x", header=broken, body=BODY, now=1700000000)


def test_secrets_are_derived_per_subscription_and_nonce_and_from_the_server_key():
    one = subscription_secret(subscription_id=1, nonce="a" * 32)
    assert one.startswith("whsec_") and len(one) > 40
    assert one == subscription_secret(subscription_id=1, nonce="a" * 32)
    assert one != subscription_secret(subscription_id=2, nonce="a" * 32)
    assert one != subscription_secret(subscription_id=1, nonce="b" * 32)
    with override_settings(QINGLONG_WEBHOOK_SECRET="another-server-key"):
        assert one != subscription_secret(subscription_id=1, nonce="a" * 32)


def test_the_readme_receiver_snippet_accepts_our_signature_and_refuses_a_forgery():
    from pathlib import Path

    from django.conf import settings

    readme = (Path(settings.BASE_DIR) / "README.md").read_text()
    [code] = [
        block.split("```", 1)[0]
        for block in readme.split("```python\n")[1:]
        if "def verified(" in block.split("```", 1)[0]
    ]
    scope: dict[str, object] = {}
    exec(code, scope)  # the documented receiver, as an operator would copy it
    verified = scope["verified"]
    header = signature_header(secret="whsec_x", body=BODY)
    assert verified("whsec_x", header, BODY)
    assert not verified("whsec_y", header, BODY)
    assert not verified("whsec_x", header, BODY + b"x")
