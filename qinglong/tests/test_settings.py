"""Settings from the environment: loud failures, production defaults, local key."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qinglong.env import ImproperEnvironment, env_bool, env_int, env_list
from qinglong.settings import _local_secret_key

ROOT = Path(__file__).resolve().parents[2]


def _manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DEBUG"}}
    base.update(
        {"DJANGO_SETTINGS_MODULE": "qinglong.settings", "DATABASE_URL": "sqlite://:memory:"}
    )
    base.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_env_helpers_fail_loudly_naming_the_variable(monkeypatch):
    monkeypatch.setenv("QL_X", "ten")
    with pytest.raises(ImproperEnvironment, match="QL_X"):
        env_int("QL_X", 1)
    monkeypatch.setenv("QL_X", "maybe")
    with pytest.raises(ImproperEnvironment, match="QL_X"):
        env_bool("QL_X", False)
    monkeypatch.setenv("QL_X", "-3")
    with pytest.raises(ImproperEnvironment, match=">= 0"):
        env_int("QL_X", 1, minimum=0)
    monkeypatch.setenv("QL_X", " a, b ,,c ")
    assert env_list("QL_X", []) == ["a", "b", "c"]
    monkeypatch.setenv("QL_X", "Yes")
    assert env_bool("QL_X", False) is True


def test_local_secret_key_is_made_once_private_and_kept(tmp_path):
    path = tmp_path / "var" / "secret_key"
    first = _local_secret_key(path)
    assert len(first) >= 50
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _local_secret_key(path) == first
    assert _local_secret_key(tmp_path / "other" / "secret_key") != first


def test_production_refuses_to_start_without_a_secret_key():
    result = _manage("check", QL_PRODUCTION="1")
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_production_refuses_debug():
    result = _manage("check", QL_PRODUCTION="1", DEBUG="1", SECRET_KEY="x" * 60)
    assert result.returncode != 0
    assert "DEBUG must be off" in result.stderr


def test_bad_environment_value_stops_startup_naming_it():
    result = _manage("check", QL_DISPATCH_MAX_CLAIM_ATTEMPTS="lots", SECRET_KEY="x" * 60)
    assert result.returncode != 0
    assert "QL_DISPATCH_MAX_CLAIM_ATTEMPTS" in result.stderr


def test_lost_execution_grace_defaults_to_two_session_timeouts_and_refuses_a_negative():
    show = "from django.conf import settings; print(settings.QINGLONG_LOST_EXECUTION_GRACE_S)"
    derived = _manage("shell", "-v0", "-c", show, QL_SESSION_TIMEOUT_S="45", SECRET_KEY="x" * 60)
    assert derived.stdout.strip() == "90", derived.stderr
    chosen = _manage("shell", "-v0", "-c", show, QL_LOST_EXECUTION_GRACE_S="0", SECRET_KEY="x" * 60)
    assert chosen.stdout.strip() == "0", chosen.stderr
    bad = _manage("check", QL_LOST_EXECUTION_GRACE_S="-1", SECRET_KEY="x" * 60)
    assert bad.returncode != 0
    assert "QL_LOST_EXECUTION_GRACE_S" in bad.stderr


def test_check_deploy_is_clean_with_production_settings():
    key = "k3y-" + "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOP"
    result = _manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        QL_PRODUCTION="1",
        SECRET_KEY=key,
        ALLOWED_HOSTS="example.org",
    )
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


def test_cache_url_must_be_redis():
    result = _manage("check", QL_CACHE_URL="memcached://x", SECRET_KEY="x" * 60)
    assert result.returncode != 0
    assert "QL_CACHE_URL" in result.stderr
    ok = _manage("check", QL_CACHE_URL="redis://127.0.0.1:6379/3", SECRET_KEY="x" * 60)
    assert ok.returncode == 0, ok.stderr
