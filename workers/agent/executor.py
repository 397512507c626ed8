"""The `process` executor: the spec's argv as a local subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from workers.agent.protocol import SpecRefused, clean_output_tail

__all__ = ["LocalProcess", "ProcessSpawner", "resolve_cwd"]

# The child gets the spec's env over a minimal base, never the agent's whole
# environment (which may hold the agent's own secrets).
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "SYSTEMROOT")


class LocalProcess:
    def __init__(self, popen: subprocess.Popen[bytes], output: IO[bytes]) -> None:
        self._popen = popen
        self._output = output
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._popen.wait(timeout=timeout)

    def _signal_group(self, signum: int) -> None:
        # The child leads its own process group: stop what it spawned too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signum)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def output_tail(self, limit: int) -> str:
        """The newest stdout+stderr that fits `limit` (its escaped size on the
        wire, see `clean_output_tail`), decoded leniently."""
        self._output.flush()
        size = self._output.seek(0, os.SEEK_END)
        # Every character takes at least its UTF-8 bytes on the wire, so the
        # last `limit` bytes of the file hold all that can fit.
        self._output.seek(max(0, size - limit))
        data = self._output.read(limit)
        self._output.close()
        # Invalid UTF-8 and NUL bytes become U+FFFD (the control plane stores
        # text, and PostgreSQL text refuses NUL); quotes, backslashes and
        # control characters count as their JSON escapes, so the text is
        # trimmed again until the ACK body it goes into fits the server's cap.
        return clean_output_tail(data.decode("utf-8", "replace"), limit)


def resolve_cwd(workdir: Path, cwd: object) -> Path:
    """The directory a spec runs in: `cwd` relative to the work directory.

    The control plane refuses an absolute cwd or a '..' segment already; this
    is the agent's own check, on the real filesystem: symlinks are resolved,
    and whatever lands outside the work directory is refused
    (`cwd_outside_workdir`), never run.
    """
    base = workdir.resolve()
    if cwd is None:
        return base
    if not isinstance(cwd, str) or not cwd or "\x00" in cwd:
        raise SpecRefused("invalid_cwd")
    relative = Path(cwd)
    # An absolute cwd would replace the base in `base / cwd`: refuse it outright.
    if relative.is_absolute():
        raise SpecRefused("cwd_outside_workdir")
    target = (base / relative).resolve()  # realpath: symlinks followed, '..' applied
    if not target.is_relative_to(base):
        raise SpecRefused("cwd_outside_workdir")
    return target


class ProcessSpawner:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def __call__(self, spec: Mapping[str, Any]) -> LocalProcess:
        command = [str(part) for part in spec["command"]]
        cwd = resolve_cwd(self.workdir, spec.get("cwd"))
        env = {key: os.environ[key] for key in _BASE_ENV if key in os.environ}
        env.update({str(k): str(v) for k, v in dict(spec.get("env") or {}).items()})
        output = tempfile.TemporaryFile()  # noqa: SIM115  (closed by output_tail)
        try:
            popen = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError):
            # ValueError: what exec refuses before trying (a NUL in argv or env).
            output.close()
            raise
        return LocalProcess(popen, output)
