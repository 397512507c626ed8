"""Django settings for the Qinglong control plane.

Everything comes from the environment through `qinglong.env` helpers, which fail
loudly on a bad value. The embedded default is a SQLite file in the project
directory; `DATABASE_URL=postgres://…` selects PostgreSQL (psycopg 3).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from dispatch.core.budget import DispatchBudget
from qinglong.env import env_bool, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent

# QL_PRODUCTION=1 declares a deployment behind TLS: SECRET_KEY must come from
# the environment and the HTTPS-only defaults below switch on, so that
# `manage.py check --deploy` is clean. Without it (the embedded default, a
# demo, CI) the control plane serves plain HTTP on loopback.
PRODUCTION = env_bool("QL_PRODUCTION", False)
DEBUG = env_bool("DEBUG", False)
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DEBUG must be off when QL_PRODUCTION is on.")


def _local_secret_key(path: Path) -> str:
    """A random key made once per installation and kept beside the database.

    There is no built-in key to leak: a fresh clone gets its own, and restarts
    keep it (lease tokens of global claims are derived from it).
    """
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when QL_PRODUCTION is on.")
    SECRET_KEY = _local_secret_key(BASE_DIR / "var" / "secret_key")

# Production names its hosts: no loopback/testserver default that a Host header
# could match on a public deployment.
ALLOWED_HOSTS = env_list(
    "ALLOWED_HOSTS", [] if PRODUCTION else ["127.0.0.1", "localhost", "testserver"]
)
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set when QL_PRODUCTION is on.")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    # Django's admin on the console's site (the overview page; README).
    "qinglong.apps.QinglongAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "qinglong.apps.QinglongConfig",
    "runs.apps.RunsConfig",
    "workers.apps.WorkersConfig",
    "leases.apps.LeasesConfig",
    "dispatch.apps.DispatchConfig",
    "output.apps.OutputConfig",
    "notifications.apps.NotificationsConfig",
    "schedules.apps.SchedulesConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (admin, API docs) from the app itself: an edge box runs no
    # separate web server, and DEBUG stays off outside development.
    # Static files, the session's user and the messages are WhiteNoise's and
    # Django's own, passed by for /api/v1/worker/: a token-authenticated JSON
    # API carries none of them (qinglong.middleware). Session and CSRF stay
    # Django's by name: `check --deploy` looks for exactly these.
    "qinglong.middleware.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "qinglong.middleware.BrowserAuthenticationMiddleware",
    "qinglong.middleware.BrowserMessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "qinglong.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "qinglong.wsgi.application"

# --- database ---------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'qinglong.sqlite3'}")
_db: dict[str, Any] = dict(dj_database_url.parse(DATABASE_URL, conn_max_age=0))
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # One writer at a time: BEGIN IMMEDIATE takes the write lock up front so a
    # claim never upgrades a read lock into a deadlock; WAL lets readers run
    # beside the writer; the timeout waits for the lock instead of failing.
    _db["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": env_int("SQLITE_BUSY_TIMEOUT_S", 20, minimum=1),
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    _db["TEST"] = {"NAME": env_str("SQLITE_TEST_NAME", "") or None}
elif _db["ENGINE"] == "django.db.backends.postgresql":
    # Persistent connections (issue #12): a new PostgreSQL connection per
    # request (a backend process forked, authenticated, set up) cost more than
    # the request's own queries. Each web thread keeps one for up to this many
    # seconds, checked before reuse (CONN_HEALTH_CHECKS), so max_connections
    # must cover web workers x threads plus dispatchers; 0 = one per request.
    _db["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60, minimum=0)
    _db["CONN_HEALTH_CHECKS"] = True
    # Django's backend, but a connection handed out less than a second ago
    # (and marked by no error since) is not pinged again before reuse: the
    # ping was a round trip per Worker request (qinglong/db/postgresql).
    _db["ENGINE"] = "qinglong.db.postgresql"
    _db.setdefault("OPTIONS", {})
    _db["OPTIONS"].setdefault("connect_timeout", env_int("DB_CONNECT_TIMEOUT_S", 5, minimum=1))
else:
    raise ImproperlyConfigured(
        f"DATABASE_URL must be sqlite:// or postgres://, got {_db['ENGINE']}"
    )
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- i18n / static -----------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "var" / "static")))
if not PRODUCTION:
    # The embedded default serves from the apps (below) and keeps everything it
    # writes under var/; WhiteNoise expects the root to exist.
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Without `manage.py collectstatic` (the embedded default) WhiteNoise finds the
# files in the installed apps; a production image runs collectstatic and gets
# compressed, cache-busting file names.
WHITENOISE_USE_FINDERS = not PRODUCTION
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if PRODUCTION
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
}

# --- security (production defaults; `manage.py check --deploy` stays clean) --
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", PRODUCTION)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", PRODUCTION)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if PRODUCTION else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
# Trust X-Forwarded-Proto only behind a proxy that sets it (and drops a
# client's): otherwise any client could claim HTTPS.
if env_bool("QL_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SILENCED_SYSTEM_CHECKS = env_list("SILENCED_SYSTEM_CHECKS", [])
if env_bool("QL_ALLOW_PRELOAD_UNSET", True):
    # HSTS preload is an opt-in commitment to browser vendors, not a default.
    SILENCED_SYSTEM_CHECKS.append("security.W021")

# Admin messages can carry a rotated Worker credential (shown once): keep them
# server-side in the session, never in a (signed, readable) cookie.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# Request bodies are capped; the worker API enforces its own smaller caps too.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 256 * 1024, minimum=1024)
# Load balancers probe /healthz over plain HTTP inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]

# --- dispatch (docs/adr/0001); validated by the qinglong.checks system check -----
# The defaults live in one place, the core's DispatchBudget (plain Python).
_DISPATCH_DEFAULTS: dict[str, int] = asdict(DispatchBudget())
QINGLONG_DISPATCH: dict[str, int] = {
    key: env_int(f"QL_DISPATCH_{key.upper()}", default)
    for key, default in _DISPATCH_DEFAULTS.items()
}
# HMAC key for lease tokens of global claims (docs/adr/0002). Derived from
# SECRET_KEY unless set, so recovery after a restart re-derives the same token.
QINGLONG_LEASE_SECRET = env_str(
    "QL_LEASE_SECRET",
    hashlib.sha256(b"qinglong-lease-token-v1\x00" + SECRET_KEY.encode()).hexdigest(),
)
QINGLONG_HEARTBEAT_INTERVAL_S = env_int("QL_HEARTBEAT_INTERVAL_S", 10, minimum=1)
QINGLONG_SESSION_TIMEOUT_S = env_int("QL_SESSION_TIMEOUT_S", 30, minimum=2)
# README "Run policies": an Attempt running this long past its Task's timeout_s
# is stopped by the control plane (heartbeat `stop`) and ended `timed_out`
# (leases.timeout); the margin lets the agent's own timeout act first.
QINGLONG_TIMEOUT_MARGIN_S = env_int("QL_TIMEOUT_MARGIN_S", 30, minimum=0)
# docs/adr/0005: the retry of an execution the control plane lost sight of
# (its Session replaced, offline or fenced) waits this long unless the Worker
# confirms the old process gone. Two Session timeouts: one until the offline
# sweep declares the Session lost (about when an agent that cannot heartbeat
# should have stopped its work), one for the kill grace, the sweep interval
# and clock skew.
QINGLONG_LOST_EXECUTION_GRACE_S = env_int(
    "QL_LOST_EXECUTION_GRACE_S", 2 * QINGLONG_SESSION_TIMEOUT_S, minimum=0
)
# A heartbeat sooner than this after the last recorded one of its Session is
# answered without a write (workers.services.session_heartbeat): one Worker
# beating in a loop must not slow every other Worker's heartbeats.
QINGLONG_HEARTBEAT_MIN_INTERVAL_S = env_int(
    "QL_HEARTBEAT_MIN_INTERVAL_S", QINGLONG_HEARTBEAT_INTERVAL_S // 2, minimum=0
)
if QINGLONG_HEARTBEAT_MIN_INTERVAL_S >= QINGLONG_HEARTBEAT_INTERVAL_S:
    raise ImproperlyConfigured(
        "QL_HEARTBEAT_MIN_INTERVAL_S must be less than QL_HEARTBEAT_INTERVAL_S."
    )
# Ended Sessions (offline, replaced) older than this are deleted by the
# retention sweep unless a lease points at them (kept with the lease history).
QINGLONG_SESSION_RETENTION_DAYS = env_int("QL_SESSION_RETENTION_DAYS", 7, minimum=1)
# Long-poll pulls (cluster): a pull with ?wait_s=N waits up to this long for a
# global cycle's offer announcement on Redis. 0 turns waiting off (the
# embedded default has no Redis: Workers poll).
QINGLONG_PULL_WAIT_MAX_S = env_int("QL_PULL_WAIT_MAX_S", 0, minimum=0)
# At most this many pulls wait at once per web process (each holds a server
# thread, never a database connection); beyond it a pull answers at once.
# Half the gunicorn threads per process (QL_WEB_THREADS, default 8 as in
# qinglong/gunicorn.conf.py), so heartbeats and ACKs always find a free thread.
QINGLONG_PULL_WAIT_MAX_WAITERS = env_int(
    "QL_PULL_WAIT_MAX_WAITERS", max(1, env_int("QL_WEB_THREADS", 8, minimum=1) // 2), minimum=0
)
QINGLONG_NOTIFY_REDIS_URL = env_str("QL_NOTIFY_REDIS_URL", "")
QINGLONG_CYCLE_RETENTION_S = env_int("QL_CYCLE_RETENTION_S", 7 * 24 * 3600, minimum=60)
# DispatchCycle rows (dispatch.cycles.CycleRecorder): per process, the first
# cycle of each outcome in a window of this many seconds is written at once,
# its repeats as one summary row when the window closes.
QINGLONG_CYCLE_SUMMARY_S = env_int("QL_CYCLE_SUMMARY_S", 60, minimum=1)
# A claim's transaction commits without waiting for its WAL flush on
# PostgreSQL (synchronous_commit off for that transaction only; docs/adr/0011,
# "Claims commit asynchronously"): the starting ACK, a synchronous commit
# after it in the WAL, makes it durable before anything runs. 0: wait.
QINGLONG_CLAIM_ASYNC_COMMIT = env_bool("QL_CLAIM_ASYNC_COMMIT", True)

# --- live output and webhooks (README "Live output", "Webhooks") -------------
# At most this many bytes of output are kept per Attempt: the newest chunks;
# older ones are deleted and counted (the truncation marker).
QINGLONG_OUTPUT_MAX_BYTES = env_int("QL_OUTPUT_MAX_BYTES", 1024 * 1024, minimum=64 * 1024)
# The live output of an Attempt that ended this long ago is deleted by the
# sweeps (its terminal ACK's tail stays on the Attempt).
QINGLONG_OUTPUT_RETENTION_DAYS = env_int("QL_OUTPUT_RETENTION_DAYS", 30, minimum=1)
# HMAC key the webhook signing secrets are derived from (one per subscription;
# the database holds only a random nonce). Derived from SECRET_KEY unless set.
QINGLONG_WEBHOOK_SECRET = env_str(
    "QL_WEBHOOK_SECRET",
    hashlib.sha256(b"qinglong-webhook-secret-v1\x00" + SECRET_KEY.encode()).hexdigest(),
)
# Webhook destinations must be public addresses unless this is on (private,
# loopback, link-local and other non-global addresses; plain http:// only to
# loopback). On by default only with DEBUG (./scripts/dev).
QINGLONG_WEBHOOK_ALLOW_PRIVATE = env_bool("QL_WEBHOOK_ALLOW_PRIVATE", DEBUG)
QINGLONG_WEBHOOK_TIMEOUT_S = env_int("QL_WEBHOOK_TIMEOUT_S", 5, minimum=1)
QINGLONG_WEBHOOK_MAX_ATTEMPTS = env_int("QL_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
QINGLONG_WEBHOOK_RETENTION_DAYS = env_int("QL_WEBHOOK_RETENTION_DAYS", 14, minimum=1)
# Base URL for the admin links in webhook payloads (e.g. https://ql.example.com);
# empty: the links are paths (/admin/runs/run/7/change/).
QINGLONG_PUBLIC_URL = env_str("QL_PUBLIC_URL", "").rstrip("/")

# --- metrics (README "Metrics") ------------------------------------------------
# /metrics answers a scraper presenting QL_METRICS_TOKEN as a Bearer token (only
# its digest is kept; compared in constant time) or connecting from an address
# in QL_METRICS_ALLOW (addresses or networks, matched against the direct peer,
# never X-Forwarded-For). With neither set it answers 403 to everyone.
_metrics_token = env_str("QL_METRICS_TOKEN", "")
if _metrics_token and len(_metrics_token) < 16:
    raise ImproperlyConfigured("QL_METRICS_TOKEN must be at least 16 characters.")
QINGLONG_METRICS_TOKEN_DIGEST = (
    hashlib.sha256(_metrics_token.encode()).hexdigest() if _metrics_token else ""
)
del _metrics_token
try:
    QINGLONG_METRICS_ALLOW = [
        ipaddress.ip_network(item, strict=False) for item in env_list("QL_METRICS_ALLOW", [])
    ]
except ValueError as _err:
    raise ImproperlyConfigured(
        f"QL_METRICS_ALLOW must list IP addresses or networks: {_err}"
    ) from None
# prometheus_client's multi-process mode (every process of a box writes its
# values to files there; one scrape sums them): it must be a writable directory.
_metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
if _metrics_dir is not None and not (
    Path(_metrics_dir).is_dir() and os.access(_metrics_dir, os.W_OK | os.X_OK)
):
    raise ImproperlyConfigured(
        f"PROMETHEUS_MULTIPROC_DIR must be an existing writable directory: {_metrics_dir!r}"
    )

# --- Django REST framework / OpenAPI ----------------------------------------
REST_FRAMEWORK: dict[str, Any] = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # DRF's Token scheme, the User's permissions read with it (issue #12).
        "qinglong.api_auth.OperatorTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    # DRF's renderer minus its 6-byte U+2028/U+2029 escapes (pull response budget).
    "DEFAULT_RENDERER_CLASSES": ["qinglong.api_renderers.WireJSONRenderer"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
    # One error envelope for every API failure (README "Worker API").
    "EXCEPTION_HANDLER": "qinglong.api_errors.api_exception_handler",
    # Worker pull, heartbeat / session open, keyed by Session / Worker
    # (workers.api.throttles).
    "DEFAULT_THROTTLE_RATES": {
        "worker_pull": env_str("QL_THROTTLE_WORKER_PULL", "600/min"),
        "worker_heartbeat": env_str("QL_THROTTLE_WORKER_HEARTBEAT", "120/min"),
        "worker_session_open": env_str("QL_THROTTLE_WORKER_SESSION_OPEN", "30/min"),
        # Live output, per lease (= per Attempt): the reference agent sends at most
        # one chunk a second (workers/agent/output.py).
        "worker_output": env_str("QL_THROTTLE_WORKER_OUTPUT", "120/min"),
        # A reconcile report is sent once after an agent restart (docs/adr/0005).
        "worker_reconcile": env_str("QL_THROTTLE_WORKER_RECONCILE", "30/min"),
    },
}
for _scope, _rate in REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"].items():
    if not re.fullmatch(r"[1-9][0-9]*/(s|sec|m|min|h|hour|d|day)", _rate):
        raise ImproperlyConfigured(f"throttle rate for {_scope} must look like 600/min")
if DEBUG:
    REST_FRAMEWORK["DEFAULT_RENDERER_CLASSES"].append(
        "rest_framework.renderers.BrowsableAPIRenderer"
    )
SPECTACULAR_SETTINGS = {
    # Swagger UI served from this installation: edge boxes have no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "TITLE": "Qinglong control plane API",
    "DESCRIPTION": "Worker protocol (sessions, heartbeat, pull, ACK) and operator API.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # One named enum per state machine in the schema (no "State982Enum").
    "ENUM_NAME_OVERRIDES": {
        "RunStateEnum": "runs.models.RunState",
        "AttemptStateEnum": "runs.models.AttemptState",
        "LeaseStateEnum": "leases.models.LeaseState",
        "CurrentSessionStateEnum": ["online", "draining"],
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "qinglong.api_schema.close_request_bodies",
        "workers.api.schema.ack_request_per_phase",
        "qinglong.api_schema.describe_protocol",
    ],
}

# --- Celery (cluster deployment; the embedded default runs without it) ------
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", "") or None
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"

# --- cache (API throttling) ---------------------------------------------------
# Throttle counters must be shared by every web process, or each limit
# multiplies with the number of processes. The cluster (PostgreSQL) shares
# them in Redis: QL_CACHE_URL, else the Celery broker when it is Redis. The
# embedded default (SQLite, no Redis) counts in per-process memory, as does
# QL_CACHE_URL=memory (e.g. a PostgreSQL box without Redis).
_REDIS_SCHEMES = ("redis://", "rediss://")
_CACHE_URL = env_str("QL_CACHE_URL", "")
if not _CACHE_URL and _db["ENGINE"] == "qinglong.db.postgresql":
    _CACHE_URL = CELERY_BROKER_URL if CELERY_BROKER_URL.startswith(_REDIS_SCHEMES) else "memory"
if _CACHE_URL and _CACHE_URL != "memory" and not _CACHE_URL.startswith(_REDIS_SCHEMES):
    raise ImproperlyConfigured("QL_CACHE_URL must be a redis:// or rediss:// URL, or memory.")
CACHES: dict[str, Any] = {
    "default": (
        {
            "BACKEND": "qinglong.cache.RedisCache",
            "LOCATION": _CACHE_URL,
            # A hung Redis costs a request at most this long; the throttles then
            # let the request through (workers.api.throttles).
            "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
        }
        if _CACHE_URL.startswith(_REDIS_SCHEMES)
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# --- logging -----------------------------------------------------------------
LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()
LOGGING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    # One redaction filter on every handler: no record is written unmasked.
    "filters": {"redact": {"()": "qinglong.logging.RedactionFilter"}},
    "formatters": {"json": {"()": "qinglong.logging.JsonFormatter"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "filters": ["redact"],
            "formatter": "json",
        }
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "qinglong": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
    },
}
