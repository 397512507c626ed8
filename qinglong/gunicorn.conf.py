"""gunicorn configuration of a Qinglong web node (the cluster's web server).

    gunicorn -c qinglong/gunicorn.conf.py qinglong.wsgi:application

Threaded workers (`gthread`): a Worker's long-poll pull (`?wait_s=N`) holds a
thread, not a whole process. Everything comes from the environment; a bad
value stops gunicorn with the variable's name:

| variable | default | meaning |
|---|---|---|
| `QL_WEB_BIND` | `127.0.0.1:8000` | address:port (comma-separated for several) |
| `QL_WEB_WORKERS` | 2 | worker processes (about one per core) |
| `QL_WEB_THREADS` | 8 | threads per worker process |
| `QL_WEB_TIMEOUT_S` | 30 | a worker silent this long is killed and replaced |
| `QL_WEB_GRACEFUL_TIMEOUT_S` | 30 | on SIGTERM/HUP, requests in flight get this long to finish |
| `QL_WEB_KEEPALIVE_S` | 5 | idle keep-alive connections are closed after this long |
| `QL_WEB_ACCESS_LOG` | off | `on`: one redacted line per request on stdout |
| `PROMETHEUS_MULTIPROC_DIR` | unset | one scrape sums every worker's metrics (README "Metrics") |

The access log, when on, has method, path (no query string), status, size and
duration only: never a header (so never `Authorization`), a body or a
cookie. This file is self-contained (gunicorn loads it before the project is
on `sys.path`).
"""

from __future__ import annotations

import os


def _int(name: str, default: int, *, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SystemExit(f"{name} must be >= {minimum}, got {value}")
    return value


def _on(name: str) -> bool:
    raw = os.environ.get(name, "off").strip().lower()
    if raw not in {"1", "true", "yes", "on", "0", "false", "no", "off", ""}:
        raise SystemExit(f"{name} must be on or off, got {raw!r}")
    return raw in {"1", "true", "yes", "on"}


wsgi_app = "qinglong.wsgi:application"
bind = [part.strip() for part in os.environ.get("QL_WEB_BIND", "127.0.0.1:8000").split(",")]
worker_class = "gthread"
workers = _int("QL_WEB_WORKERS", 2, minimum=1)
threads = _int("QL_WEB_THREADS", 8, minimum=1)
timeout = _int("QL_WEB_TIMEOUT_S", 30, minimum=1)
graceful_timeout = _int("QL_WEB_GRACEFUL_TIMEOUT_S", 30, minimum=1)
keepalive = _int("QL_WEB_KEEPALIVE_S", 5, minimum=0)

# Logging: errors on stderr; the access log is off unless asked for, and then
# carries no header, query string or body (tokens travel in Authorization).
errorlog = "-"
loglevel = "info"
accesslog = "-" if _on("QL_WEB_ACCESS_LOG") else None
access_log_format = '%(h)s "%(m)s %(U)s %(H)s" %(s)s %(B)s %(M)sms'

# The scheme is Django's decision alone (QL_TRUST_X_FORWARDED_PROTO): gunicorn
# must not turn a loopback client's X-Forwarded-Proto into https on its own.
secure_scheme_headers: dict[str, str] = {}
# Several nodes may share a host: no per-user control socket to fight over.
control_socket_disable = True


def child_exit(server: object, worker: object) -> None:
    """A worker process exited: tell prometheus_client's multi-process mode.

    With `PROMETHEUS_MULTIPROC_DIR` set (README "Metrics") every worker writes
    its metric values to files there and a scrape sums them; a dead worker's
    live gauges must be dropped (its counters stay, as counters should).
    """
    pid = getattr(worker, "pid", None)
    if pid is None or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    # Imported only in multi-process mode, in the arbiter (never in a worker).
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
