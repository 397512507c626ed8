"""No browser is an error, never a silent pass: the fixture and scripts/test both say so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

from qinglong.tests.browser.chromium import require_chromium

ROOT = Path(settings.BASE_DIR)


def test_fixture_fails_naming_the_package_and_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("QL_CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(pytest.fail.Exception) as failed:
        require_chromium()
    message = str(failed.value)
    assert str(tmp_path / "no-chromium") in message
    assert "apt-get install chromium" in message
    assert "QL_CHROMIUM" in message


def test_fixture_refuses_a_file_that_is_not_executable(monkeypatch, tmp_path):
    binary = tmp_path / "chromium"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o644)
    monkeypatch.setenv("QL_CHROMIUM", str(binary))
    with pytest.raises(pytest.fail.Exception):
        require_chromium()
    binary.chmod(0o755)
    assert require_chromium() == str(binary)


def _require_in_shell(chromium: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QL_CHROMIUM": str(chromium)}
    return subprocess.run(
        ["bash", "-c", "source scripts/_chromium.sh && ql_require_chromium"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_test_script_check_fails_with_the_same_message(monkeypatch, tmp_path):
    # QL_CHROMIUM is set, so the check never tries to install anything.
    missing = tmp_path / "no-chromium"
    done = _require_in_shell(missing)
    assert done.returncode == 1
    monkeypatch.setenv("QL_CHROMIUM", str(missing))
    with pytest.raises(pytest.fail.Exception) as failed:
        require_chromium()
    assert done.stderr.strip() == str(failed.value)


def test_test_script_check_passes_an_executable(tmp_path):
    binary = tmp_path / "chromium"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    done = _require_in_shell(binary)
    assert (done.returncode, done.stderr) == (0, "")


def _fake_apt_get(tmp_path: Path, *, lists: bool) -> Path:
    """An apt-get that logs its arguments; install fails until `update` ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text(
        f"#!/bin/sh\nD={tmp_path}\n"
        'echo "$*" >> "$D/calls"\n'
        'case "$*" in *update*) touch "$D/lists" ;; esac\n'
        'case "$*" in *install*) [ -e "$D/lists" ] || exit 100 ;; esac\n'
    )
    script.chmod(0o755)
    if lists:
        (tmp_path / "lists").touch()
    return bin_dir


def _install_with(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", "source scripts/_chromium.sh && ql_install_chromium"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_install_runs_apt_get_update_only_when_the_install_needs_it(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    done = _install_with(_fake_apt_get(ready, lists=True))
    assert done.returncode == 0
    assert (ready / "calls").read_text().splitlines() == ["install -y -qq chromium"]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    done = _install_with(_fake_apt_get(fresh, lists=False))
    assert done.returncode == 0
    assert (fresh / "calls").read_text().splitlines() == [
        "install -y -qq chromium",
        "update -qq",
        "install -y -qq chromium",
    ]


def test_install_failure_shows_apt_gets_output(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text('#!/bin/sh\necho "E: Unable to locate package chromium" >&2\nexit 100\n')
    script.chmod(0o755)
    done = _install_with(bin_dir)
    assert done.returncode == 1
    assert "E: Unable to locate package chromium" in done.stderr
