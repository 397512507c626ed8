"""The gunicorn config of the cluster's web nodes: known settings, env, no leaks."""

from __future__ import annotations

import http.client
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gunicorn.config import Config

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "qinglong" / "gunicorn.conf.py"
CANARY = "CANARY-GUNICORN-4e1d0"
QUERY_CANARY = "CANARY-QUERY-93c2a"


def _load(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    for name in [k for k in os.environ if k.startswith("QL_WEB_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    values = runpy.run_path(str(CONF))
    return {k: v for k, v in values.items() if not k.startswith("_") and k != "os"}


def test_every_setting_is_one_gunicorn_knows_and_accepts(monkeypatch):
    # gunicorn silently skips unknown names in a config file: a typo would
    # quietly fall back to a default (e.g. the sync worker, or an access log).
    settings = _load(monkeypatch)
    cfg = Config()
    for name, value in settings.items():
        if name == "annotations":
            continue
        assert name in cfg.settings, name
        cfg.set(name, value)
    assert cfg.worker_class_str == "gthread"
    assert (cfg.workers, cfg.threads) == (2, 8)
    assert cfg.address == [("127.0.0.1", 8000)]
    assert cfg.accesslog is None
    assert cfg.graceful_timeout == 30
    assert cfg.secure_scheme_headers == {}


def test_sizes_and_bind_come_from_the_environment_and_bad_values_name_the_variable(
    monkeypatch,
):
    settings = _load(
        monkeypatch,
        QL_WEB_WORKERS="3",
        QL_WEB_THREADS="4",
        QL_WEB_BIND="0.0.0.0:9000",
        QL_WEB_GRACEFUL_TIMEOUT_S="7",
        QL_WEB_ACCESS_LOG="on",
    )
    assert (settings["workers"], settings["threads"]) == (3, 4)
    assert settings["bind"] == ["0.0.0.0:9000"]
    assert settings["graceful_timeout"] == 7
    assert settings["accesslog"] == "-"
    with pytest.raises(SystemExit, match="QL_WEB_THREADS"):
        _load(monkeypatch, QL_WEB_THREADS="many")
    with pytest.raises(SystemExit, match="QL_WEB_WORKERS"):
        _load(monkeypatch, QL_WEB_WORKERS="0")
    with pytest.raises(SystemExit, match="QL_WEB_ACCESS_LOG"):
        _load(monkeypatch, QL_WEB_ACCESS_LOG="verbose")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_ECHO_APP = """
def application(environ, start_response):
    # Reads the body and answers: the request went all the way through.
    size = int(environ.get("CONTENT_LENGTH") or 0)
    environ["wsgi.input"].read(size)
    start_response("201 Created", [("Content-Type", "text/plain")])
    return [b"ok"]
"""


@pytest.mark.slow
def test_access_log_shows_no_header_query_string_or_body(tmp_path):
    # A stand-in WSGI app (the config is under test, not Django): gunicorn
    # writes no access line for a request whose app raised.
    (tmp_path / "echo_app.py").write_text(_ECHO_APP)
    port = _free_port()
    env = {
        **os.environ,
        "QL_WEB_BIND": f"127.0.0.1:{port}",
        "QL_WEB_WORKERS": "1",
        "QL_WEB_THREADS": "2",
        "QL_WEB_ACCESS_LOG": "on",
    }
    log = tmp_path / "gunicorn.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                str(CONF),
                "--pythonpath",
                str(tmp_path),
                "echo_app:application",
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request(
                    "POST",
                    f"/api/v1/runs?cursor={QUERY_CANARY}",
                    body=f'{{"project": "{CANARY}", "task": "t"}}',
                    headers={
                        "Authorization": f"Token {CANARY}",
                        "Content-Type": "application/json",
                        "Cookie": f"sessionid={CANARY}",
                        "User-Agent": CANARY,
                        "Referer": f"http://x/{CANARY}",
                    },
                )
                status = conn.getresponse().status
                conn.close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert status == 201
    text = log.read_text()
    access = [line for line in text.splitlines() if '"POST /api/v1/runs HTTP/1.1"' in line]
    assert len(access) == 1
    assert " 201 " in access[0]
    assert CANARY not in text
    assert QUERY_CANARY not in text
