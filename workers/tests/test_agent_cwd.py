"""The agent runs a spec only inside its work directory (issue 8, item 7).

The control plane's one validator already refuses an absolute cwd or a '..'
segment; the agent checks again on its own filesystem (symlinks resolved) and
ends a spec whose cwd lands outside `--workdir` as `start_failed` with
`cwd_outside_workdir`, spawning nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workers.agent.executor import ProcessSpawner, resolve_cwd
from workers.agent.protocol import AttemptOutcome, AttemptRunner, SpecRefused
from workers.tests.test_agent import TOKEN, FakeTransport, a_spec, an_offer


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    root = tmp_path / "work"
    (root / "jobs" / "nightly").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    # A link out of the work directory, and one that stays inside it.
    (root / "escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    (root / "shortcut").symlink_to(root / "jobs", target_is_directory=True)
    return root


@pytest.mark.parametrize(
    ("cwd", "inside"),
    [
        (None, "."),
        (".", "."),
        ("jobs", "jobs"),
        ("jobs/nightly", "jobs/nightly"),
        ("./jobs//nightly/", "jobs/nightly"),
        ("shortcut/nightly", "jobs/nightly"),  # a symlink that stays inside
        ("not-yet-there", "not-yet-there"),  # Popen reports that one
    ],
)
def test_a_relative_cwd_resolves_inside_the_work_directory(
    workdir: Path, cwd: str | None, inside: str
) -> None:
    assert resolve_cwd(workdir, cwd) == (workdir / inside).resolve()


@pytest.mark.parametrize(
    "cwd",
    ["/etc", "/", "..", "../outside", "jobs/../../outside", "escape", "escape/sub", "//x"],
)
def test_a_cwd_that_lands_outside_the_work_directory_is_refused(workdir: Path, cwd: str) -> None:
    with pytest.raises(SpecRefused) as err:
        resolve_cwd(workdir, cwd)
    assert err.value.code == "cwd_outside_workdir"


def test_the_absolute_form_of_a_directory_inside_is_refused_too(workdir: Path) -> None:
    # One rule on both sides: relative to the work directory, never absolute.
    with pytest.raises(SpecRefused):
        resolve_cwd(workdir, str(workdir / "jobs"))


@pytest.mark.parametrize("cwd", ["", "a\x00b", 5, ["jobs"]])
def test_a_malformed_cwd_is_refused(workdir: Path, cwd: object) -> None:
    with pytest.raises(SpecRefused) as err:
        resolve_cwd(workdir, cwd)
    assert err.value.code == "invalid_cwd"


def _run(workdir: Path, cwd: str) -> tuple[AttemptOutcome, FakeTransport, Path]:
    marker = workdir.parent / "outside" / "ran"
    script = f"open({str(marker)!r}, 'w').write('ran')"
    offer = an_offer(a_spec(command=[sys.executable, "-c", script], cwd=cwd))
    transport = FakeTransport()
    runner = AttemptRunner(
        transport=transport,
        session_token="s" * 43,
        offer=offer,
        lease_token=TOKEN,
        spawn=ProcessSpawner(workdir),
        poll_interval_s=0.01,
    )
    return runner.run(), transport, marker


@pytest.mark.parametrize("cwd", ["/tmp", "escape", "../outside"])
def test_the_agent_reports_start_failed_and_spawns_nothing(workdir: Path, cwd: str) -> None:
    outcome, transport, marker = _run(workdir, cwd)
    assert [call["phase"] for call in transport.calls] == ["starting", "start_failed"]
    assert transport.calls[-1]["error_code"] == "cwd_outside_workdir"
    assert (outcome.ran, outcome.final_phase) == (False, "start_failed")
    assert outcome.stopped == "cwd_outside_workdir"
    assert not marker.exists()


def test_a_cwd_inside_runs_there(workdir: Path) -> None:
    process = ProcessSpawner(workdir)(
        a_spec(
            command=[sys.executable, "-c", "import os; print(os.getcwd())"],
            cwd="shortcut/nightly",
        )
    )
    assert process.wait(timeout=30) == 0
    assert process.release(grace_s=1) == 0
    tail = process.output_tail(4096)
    process.close()
    assert tail.strip() == str((workdir / "jobs" / "nightly").resolve())
