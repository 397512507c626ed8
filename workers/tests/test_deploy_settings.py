"""Production settings that protect the Worker API's hosts and HTTPS detection.

(Here rather than in qinglong/tests because those files have another owner.)

- QL_PRODUCTION=1 needs ALLOWED_HOSTS from the environment: no loopback or
  `testserver` default that a forged Host header could match.
- X-Forwarded-Proto is trusted only with QL_TRUST_X_FORWARDED_PROTO=1: behind
  no proxy (or one that passes the client's header through) any client could
  otherwise claim HTTPS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import RequestFactory

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-" + "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOP"
_CLEARED = {"SECRET_KEY", "DEBUG", "ALLOWED_HOSTS", "QL_PRODUCTION", "QL_TRUST_X_FORWARDED_PROTO"}
_PROBE = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'hosts': s.ALLOWED_HOSTS, 'proxy': s.SECURE_PROXY_SSL_HEADER}))"
)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    base.update(
        {"DJANGO_SETTINGS_MODULE": "qinglong.settings", "DATABASE_URL": "sqlite://:memory:"}
    )
    base.update(env)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=120
    )


def _settings(**env: str) -> dict[str, Any]:
    result = _run(["-c", _PROBE], **env)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_production_refuses_to_start_without_allowed_hosts() -> None:
    for hosts in (None, ""):
        env = {"QL_PRODUCTION": "1", "SECRET_KEY": KEY}
        if hosts is not None:
            env["ALLOWED_HOSTS"] = hosts
        result = _run(["manage.py", "check"], **env)
        assert result.returncode != 0
        assert "ALLOWED_HOSTS must be set" in result.stderr


def test_production_hosts_come_only_from_the_environment() -> None:
    got = _settings(QL_PRODUCTION="1", SECRET_KEY=KEY, ALLOWED_HOSTS="example.org")
    assert got["hosts"] == ["example.org"]


def test_development_keeps_its_loopback_defaults() -> None:
    assert _settings()["hosts"] == ["127.0.0.1", "localhost", "testserver"]


def test_x_forwarded_proto_is_trusted_only_when_asked() -> None:
    production = {"QL_PRODUCTION": "1", "SECRET_KEY": KEY, "ALLOWED_HOSTS": "example.org"}
    assert _settings(**production)["proxy"] is None
    assert _settings()["proxy"] is None
    trusted = _settings(**production, QL_TRUST_X_FORWARDED_PROTO="1")
    assert trusted["proxy"] == ["HTTP_X_FORWARDED_PROTO", "https"]


def test_a_spoofed_x_forwarded_proto_does_not_make_a_request_secure() -> None:
    # The test settings are the untrusting default.
    request = RequestFactory().get("/api/v1/worker/pull", HTTP_X_FORWARDED_PROTO="https")
    assert request.is_secure() is False


@pytest.mark.parametrize("trust", ["0", "1"])
def test_check_deploy_is_clean_with_production_settings(trust: str) -> None:
    result = _run(
        ["manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        QL_PRODUCTION="1",
        SECRET_KEY=KEY,
        ALLOWED_HOSTS="example.org",
        QL_TRUST_X_FORWARDED_PROTO=trust,
    )
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout
