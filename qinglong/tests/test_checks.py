"""A dispatch budget over a hard cap refuses to start (docs/adr/0001).

`manage.py check` (and so every command, the web server and the Celery worker)
must fail with an Error naming the offending key; the defaults must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks import Error, run_checks
from django.test.utils import override_settings

from dispatch.core.budget import DispatchBudget

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS: dict[str, int] = {
    "recovery_page_size": 8,
    "recovery_max_pages": 2,
    "candidate_page_size": 8,
    "candidate_max_pages": 2,
    "worker_page_size": 8,
    "worker_max_pages": 2,
    "max_claim_attempts": 8,
    "lease_ttl_s": 60,
    "redelivery_backoff_s": 5,
    "max_deliveries": 5,
    "max_delivery_rounds": 3,
}


def budget_errors(**overrides: object) -> list[Error]:
    with override_settings(QINGLONG_DISPATCH={**DEFAULTS, **overrides}):
        return [
            message
            for message in run_checks(tags=["qinglong"])
            if isinstance(message, Error) and message.id == "qinglong.E001"
        ]


def test_default_budget_passes_the_system_checks() -> None:
    assert budget_errors() == []
    assert DispatchBudget() == DispatchBudget.from_mapping(DEFAULTS)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("recovery_page_size", 65),
        ("recovery_max_pages", 17),
        ("candidate_page_size", 65),
        ("candidate_max_pages", 17),
        ("worker_page_size", 65),
        ("worker_max_pages", 17),
        ("max_claim_attempts", 65),
        ("recovery_page_size", 0),
        ("max_claim_attempts", 0),
    ],
)
def test_each_hard_cap_violation_is_an_error_naming_its_key(key: str, value: int) -> None:
    errors = budget_errors(**{key: value})
    assert errors, f"{key}={value} passed the checks"
    assert any(repr(key) in error.msg for error in errors)
    assert any(f"QL_DISPATCH_{key.upper()}" in (error.hint or "") for error in errors)


def test_worker_pages_times_size_over_64_is_an_error_even_within_each_cap() -> None:
    errors = budget_errors(worker_page_size=16, worker_max_pages=8)
    assert [error.msg for error in errors if "worker_max_pages" in error.msg]
    assert budget_errors(worker_page_size=16, worker_max_pages=4) == []


def test_largest_allowed_budget_passes() -> None:
    assert (
        budget_errors(
            recovery_page_size=64,
            recovery_max_pages=16,
            candidate_page_size=64,
            candidate_max_pages=16,
            worker_page_size=64,
            worker_max_pages=1,
            max_claim_attempts=64,
        )
        == []
    )


def test_unknown_or_non_integer_budget_values_are_errors() -> None:
    assert any("page_sise" in e.msg for e in budget_errors(page_sise=8))
    assert any("max_claim_attempts" in e.msg for e in budget_errors(max_claim_attempts="8"))


# ---------------------------------------------------------- real processes


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("QL_DISPATCH_") and key != "PYTEST_CURRENT_TEST"
    }
    full_env.update(DJANGO_SETTINGS_MODULE="qinglong.settings_test", **env)
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_environment_override_reaches_the_settings() -> None:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings; "
            "print(settings.QINGLONG_DISPATCH['candidate_page_size'])",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "qinglong.settings_test",
            "QL_DISPATCH_CANDIDATE_PAGE_SIZE": "32",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "32"


@pytest.mark.slow
def test_manage_check_refuses_a_budget_over_a_hard_cap() -> None:
    result = manage("check", QL_DISPATCH_MAX_CLAIM_ATTEMPTS="65")
    assert result.returncode != 0
    assert "max_claim_attempts" in result.stderr
    assert "qinglong.E001" in result.stderr


@pytest.mark.slow
def test_manage_check_is_clean() -> None:
    result = manage("check", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_migrations_are_up_to_date() -> None:
    result = manage("makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
