"""The one validator for task definitions and ExecutionSpecs.

docs/adr/0001 step 5: the Django Task form, the REST API and `dispatch_once`
all call these functions, so there is never a second set of rules to drift.
Every rule violation is a `SpecError` naming the field (never the value).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from types import MappingProxyType
from typing import Final

from dispatch.core._validate import (
    EXECUTOR_TYPE_RE,
    require_int,
    require_str,
    validate_executor_type,
)
from dispatch.core.errors import SpecError
from dispatch.core.placement import Placement, normalize_placement, validate_placement

__all__ = [
    "DEFAULT_RESOURCES",
    "ENV_KEY_RE",
    "EXECUTOR_TYPE_RE",
    "ID_FIELDS",
    "MAX_ATTEMPTS_LIMIT",
    "MAX_COMMAND_ITEMS",
    "MAX_COMMAND_ITEM_CHARS",
    "MAX_COMMAND_TOTAL_CHARS",
    "MAX_CONCURRENT_RUNS_LIMIT",
    "MAX_CPU_MILLIS",
    "MAX_CWD_CHARS",
    "MAX_ENV_ITEMS",
    "MAX_ENV_VALUE_CHARS",
    "MAX_ID_CHARS",
    "MAX_MEMORY_MB",
    "MAX_RETRY_BACKOFF_S",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_PAYLOAD_BYTES",
    "MAX_TIMEOUT_S",
    "SPEC_FIELDS",
    "SPEC_VERSION",
    "PreparedSpec",
    "RetryOn",
    "RunPolicy",
    "SpecTemplate",
    "TaskDefinition",
    "build_spec",
    "canonical_json",
    "check_spec_identity",
    "spec_sha256",
    "validate_command",
    "validate_cwd",
    "validate_env",
    "validate_executor_type",
    "validate_id",
    "validate_max_attempts",
    "validate_resources",
    "validate_run_policy",
    "validate_spec",
    "validate_task_definition",
    "validate_timeout_s",
]

SPEC_VERSION: Final = 1
MAX_COMMAND_ITEMS: Final = 256
MAX_COMMAND_ITEM_CHARS: Final = 4096
MAX_COMMAND_TOTAL_CHARS: Final = 32768
MAX_ENV_ITEMS: Final = 128
MAX_ENV_VALUE_CHARS: Final = 32768
MAX_CWD_CHARS: Final = 1024
# command + cwd + env together, as canonical JSON (UTF-8, control characters as
# 6-byte escapes): what a spec costs on the wire. The per-field limits alone
# allow 128 env values of 32768 characters (over 4 MiB); this bounds every
# spec, so a pull response can be bounded by construction (workers.api). Equal
# to the operator API's default body cap: any definition that body could hold
# fits, because canonical JSON is never longer than the JSON it was read from.
MAX_SPEC_PAYLOAD_BYTES: Final = 256 * 1024
MAX_TIMEOUT_S: Final = 604800
MAX_ATTEMPTS_LIMIT: Final = 100
MAX_CPU_MILLIS: Final = 1_000_000
MAX_MEMORY_MB: Final = 10_000_000
MAX_ID_CHARS: Final = 20
# Run policies (README "Run policies"): a Task's own concurrency limit and its
# retry backoff. A backoff over a day is an outage, not a retry.
MAX_CONCURRENT_RUNS_LIMIT: Final = 10_000
MAX_RETRY_BACKOFF_S: Final = 86_400
DEFAULT_RETRY_BACKOFF_MAX_S: Final = 3_600
ENV_KEY_RE: Final = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
# A read-only view: callers get copies from validate_resources(), so nobody can
# change the default for every later task by mutating it.
DEFAULT_RESOURCES: Final[Mapping[str, int]] = MappingProxyType(
    {"cpu_millis": 1000, "memory_mb": 256}
)
DEFAULT_TIMEOUT_S: Final = 3600
DEFAULT_MAX_ATTEMPTS: Final = 1

_ENV_KEY = re.compile(ENV_KEY_RE)
_ID = re.compile(r"[0-9]{1,20}")
_RESOURCE_MAX: Final[Mapping[str, int]] = MappingProxyType(
    {"cpu_millis": MAX_CPU_MILLIS, "memory_mb": MAX_MEMORY_MB}
)
# "C:", "c:/x": a Windows drive, absolute or drive-relative either way.
_DRIVE = re.compile(r"[A-Za-z]:")

ID_FIELDS: Final = ("run_id", "attempt_id", "project_id", "task_id")
SPEC_FIELDS: Final = frozenset(
    {
        "spec_version",
        *ID_FIELDS,
        "task_revision",
        "executor_type",
        "command",
        "cwd",
        "env",
        "timeout_s",
        "resources",
    }
)
_DEFINITION_FIELDS: Final = frozenset(
    {
        "executor_type",
        "command",
        "cwd",
        "env",
        "timeout_s",
        "resources",
        "placement",
        "max_attempts",
        "max_concurrent_runs",
        "retry_on",
        "retry_backoff_s",
        "retry_backoff_max_s",
    }
)


class RetryOn(enum.StrEnum):
    """Which failed Attempts get another try (while attempts < max_attempts)."""

    EXIT_CODE = "exit_code"  # the script failed: failed, start_failed, timed_out
    WORKER_LOST = "worker_lost"  # the Worker or its Session went away (lost)
    BOTH = "both"  # either (the default: what every Task did before run policies)


def validate_command(value: object) -> list[str]:
    if not isinstance(value, list | tuple):
        raise SpecError("command", "must be a list of strings")
    if not value:
        raise SpecError("command", "must not be empty")
    if len(value) > MAX_COMMAND_ITEMS:
        raise SpecError("command", f"must have at most {MAX_COMMAND_ITEMS} items")
    command: list[str] = []
    total = 0
    for index, item in enumerate(value):
        text = require_str(item, field=f"command[{index}]", max_chars=MAX_COMMAND_ITEM_CHARS)
        total += len(text)
        command.append(text)
    if not command[0].strip():
        raise SpecError("command[0]", "must name a program")
    if total > MAX_COMMAND_TOTAL_CHARS:
        raise SpecError("command", f"must total at most {MAX_COMMAND_TOTAL_CHARS} characters")
    return command


def validate_cwd(value: object) -> str | None:
    """A Task's working directory: a path relative to the Worker's work directory.

    The one cwd rule (docs/architecture.md, "cwd"), which the reference agent
    checks again on its own filesystem: '/'-separated, not absolute (no leading
    '/', no drive letter), no backslash, no '..' segment, so it can never name
    a directory outside the work directory. It comes back normalized (empty and
    '.' segments dropped: "./a//b/" is "a/b"; the work directory itself is
    "."), so a stored revision re-validates to the same spec digest; None also
    means the work directory.
    """
    if value is None:
        return None
    text = require_str(value, field="cwd", max_chars=MAX_CWD_CHARS, allow_empty=False)
    if "\\" in text:
        raise SpecError("cwd", "must separate directories with '/', never '\\'")
    if text.startswith("/") or _DRIVE.match(text):
        raise SpecError(
            "cwd",
            "must be a relative path inside the Worker's work directory "
            "(no leading '/', no drive letter)",
        )
    segments = [segment for segment in text.split("/") if segment not in ("", ".")]
    if ".." in segments:
        raise SpecError(
            "cwd", "must not contain a '..' segment (it must stay inside the work directory)"
        )
    return "/".join(segments) or "."


def validate_env(value: object) -> dict[str, str]:
    # Errors say only "env": a key or value may itself be the secret.
    if not isinstance(value, Mapping):
        raise SpecError("env", "must be an object of strings")
    if len(value) > MAX_ENV_ITEMS:
        raise SpecError("env", f"must have at most {MAX_ENV_ITEMS} variables")
    env: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or _ENV_KEY.fullmatch(key) is None:
            raise SpecError("env", "variable names must match ^[A-Za-z_][A-Za-z0-9_]{0,127}$")
        if not isinstance(item, str):
            raise SpecError("env", "values must be strings")
        if len(item) > MAX_ENV_VALUE_CHARS:
            raise SpecError("env", f"values must be at most {MAX_ENV_VALUE_CHARS} characters")
        if "\x00" in item:
            raise SpecError("env", "values must not contain NUL characters")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError("env", "values must be valid Unicode text") from None
        env[key] = item
    return env


def validate_timeout_s(value: object) -> int:
    return require_int(value, field="timeout_s", minimum=1, maximum=MAX_TIMEOUT_S)


def validate_resources(value: object) -> dict[str, int]:
    if value is None:
        return dict(DEFAULT_RESOURCES)
    if not isinstance(value, Mapping):
        raise SpecError("resources", "must be an object")
    for key in value:
        if key not in _RESOURCE_MAX:
            raise SpecError("resources", "has an unknown field")
    resources: dict[str, int] = {}
    for key, maximum in _RESOURCE_MAX.items():
        resources[key] = require_int(
            value.get(key, DEFAULT_RESOURCES[key]),
            field=f"resources.{key}",
            minimum=0,
            maximum=maximum,
        )
    return resources


def validate_max_attempts(value: object) -> int:
    return require_int(value, field="max_attempts", minimum=1, maximum=MAX_ATTEMPTS_LIMIT)


@dataclass(frozen=True)
class RunPolicy:
    """A Task's run policies, pinned in each revision (README "Run policies").

    Not part of the ExecutionSpec: the Worker never sees them, so adding them
    changes no spec digest.
    """

    max_concurrent_runs: int = 0  # per Task, besides the Project's; 0 = unlimited
    retry_on: RetryOn = RetryOn.BOTH
    retry_backoff_s: int = 0  # the first retry waits this long; each next one twice as long
    retry_backoff_max_s: int = DEFAULT_RETRY_BACKOFF_MAX_S  # the cap of that doubling

    def retries(self, *, lost: bool) -> bool:
        """Does this failure kind get another Attempt (attempts permitting)?"""
        if self.retry_on is RetryOn.BOTH:
            return True
        return (self.retry_on is RetryOn.WORKER_LOST) == lost

    def backoff_s(self, *, retry_number: int) -> int:
        """Seconds before retry `retry_number` (1 = the first retry) may be claimed."""
        if self.retry_backoff_s == 0 or retry_number < 1:
            return 0
        # 2**n grows without bound: stop doubling once past the cap.
        exponent = min(retry_number - 1, MAX_RETRY_BACKOFF_S.bit_length())
        doubled: int = self.retry_backoff_s << exponent
        return min(doubled, self.retry_backoff_max_s)


_RETRY_ON_VALUES: Final = frozenset(member.value for member in RetryOn)


def validate_run_policy(raw: Mapping[str, object]) -> RunPolicy:
    """The run-policy fields of a task definition (absent ones take the defaults)."""
    max_concurrent_runs = require_int(
        raw.get("max_concurrent_runs", 0),
        field="max_concurrent_runs",
        minimum=0,
        maximum=MAX_CONCURRENT_RUNS_LIMIT,
    )
    retry_on = raw.get("retry_on", RetryOn.BOTH.value)
    if not isinstance(retry_on, str) or retry_on not in _RETRY_ON_VALUES:
        raise SpecError("retry_on", "must be one of " + ", ".join(m.value for m in RetryOn))
    backoff = require_int(
        raw.get("retry_backoff_s", 0),
        field="retry_backoff_s",
        minimum=0,
        maximum=MAX_RETRY_BACKOFF_S,
    )
    backoff_max = require_int(
        raw.get("retry_backoff_max_s", DEFAULT_RETRY_BACKOFF_MAX_S),
        field="retry_backoff_max_s",
        minimum=0,
        maximum=MAX_RETRY_BACKOFF_S,
    )
    if backoff_max < backoff:
        raise SpecError("retry_backoff_max_s", "must be at least retry_backoff_s")
    return RunPolicy(
        max_concurrent_runs=max_concurrent_runs,
        retry_on=RetryOn(retry_on),
        retry_backoff_s=backoff,
        retry_backoff_max_s=backoff_max,
    )


def validate_id(value: object, *, field: str) -> str:
    """Ids cross the wire as decimal strings of database keys (the wire format)."""
    if not isinstance(value, str) or _ID.fullmatch(value) is None:
        raise SpecError(field, f"must be a string of 1 to {MAX_ID_CHARS} decimal digits")
    return value


@dataclass(frozen=True)
class TaskDefinition:
    """A validated TaskRevision body; the secret-bearing fields stay out of repr()."""

    executor_type: str
    command: tuple[str, ...] = field(repr=False)
    cwd: str | None = field(repr=False)
    env: Mapping[str, str] = field(repr=False)
    timeout_s: int
    resources: Mapping[str, int]
    placement: Placement
    max_attempts: int
    policy: RunPolicy = RunPolicy()


def _field_name(key: object) -> str:
    # An unknown key is named so the author can find it, but only when it looks
    # like a field name; anything else could be pasted data.
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
        return key
    return "definition"


def validate_task_definition(raw: Mapping[str, object]) -> TaskDefinition:
    if not isinstance(raw, Mapping):
        raise SpecError("definition", "must be an object")
    for key in raw:
        if key not in _DEFINITION_FIELDS:
            raise SpecError(_field_name(key), "unknown field")
    for required in ("executor_type", "command"):
        if required not in raw:
            raise SpecError(required, "is required")
    executor_type = validate_executor_type(raw["executor_type"])
    placement = normalize_placement(validate_placement(raw.get("placement")), executor_type)
    command = validate_command(raw["command"])
    cwd = validate_cwd(raw.get("cwd"))
    env = validate_env(raw.get("env", {}))
    validate_payload_size(command=command, cwd=cwd, env=env, field="definition")
    return TaskDefinition(
        executor_type=executor_type,
        command=tuple(command),
        cwd=cwd,
        env=env,
        timeout_s=validate_timeout_s(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
        resources=validate_resources(raw.get("resources")),
        placement=placement,
        max_attempts=validate_max_attempts(raw.get("max_attempts", DEFAULT_MAX_ATTEMPTS)),
        policy=validate_run_policy(raw),
    )


def build_spec(
    *,
    run_id: str,
    attempt_id: str,
    project_id: str,
    task_id: str,
    task_revision: int,
    definition: TaskDefinition,
) -> dict[str, object]:
    """The wire ExecutionSpec (the pull response's `spec`), as fresh plain containers."""
    return {
        "spec_version": SPEC_VERSION,
        "run_id": run_id,
        "attempt_id": attempt_id,
        "project_id": project_id,
        "task_id": task_id,
        "task_revision": task_revision,
        "executor_type": definition.executor_type,
        "command": list(definition.command),
        "cwd": definition.cwd,
        "env": dict(definition.env),
        "timeout_s": definition.timeout_s,
        "resources": dict(definition.resources),
    }


def validate_spec(raw: Mapping[str, object]) -> dict[str, object]:
    """docs/adr/0001 step 5: validate, deep-copy and strip unknown fields.

    The result is built only from values the validators return (new lists and
    dicts of immutable strings and ints), so nothing in it aliases `raw`.
    """
    if not isinstance(raw, Mapping):
        raise SpecError("spec", "must be an object")
    for name in sorted(SPEC_FIELDS):
        if name not in raw:
            raise SpecError(name, "is required")
    version = raw["spec_version"]
    if isinstance(version, bool) or version != SPEC_VERSION or not isinstance(version, int):
        raise SpecError("spec_version", f"must be {SPEC_VERSION}")
    spec: dict[str, object] = {"spec_version": SPEC_VERSION}
    for name in ID_FIELDS:
        spec[name] = validate_id(raw[name], field=name)
    spec["task_revision"] = require_int(
        raw["task_revision"], field="task_revision", minimum=1, maximum=2**63 - 1
    )
    spec["executor_type"] = validate_executor_type(raw["executor_type"])
    spec["command"] = validate_command(raw["command"])
    spec["cwd"] = validate_cwd(raw["cwd"])
    spec["env"] = validate_env(raw["env"])
    validate_payload_size(command=spec["command"], cwd=spec["cwd"], env=spec["env"], field="spec")
    spec["timeout_s"] = validate_timeout_s(raw["timeout_s"])
    if raw["resources"] is None:
        raise SpecError("resources", "is required")
    spec["resources"] = validate_resources(raw["resources"])
    return spec


# ------------------------------------------------- a revision's spec, validated once

# The fields a TaskRevision fixes; the rest of a spec (`spec_version`, the ids,
# `task_revision`) is the Run's.
_BODY_FIELDS: Final = ("executor_type", "command", "cwd", "env", "timeout_s", "resources")


def _canonical_value(value: object) -> str:
    """One value as `canonical_json` writes it inside a spec (same options)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


class SpecTemplate:
    """The part of an ExecutionSpec a TaskRevision fixes, validated once (issue #12).

    Built from a revision's body (`TaskDefinition` or any mapping with
    `_BODY_FIELDS`) through the same validators, in the same order, as
    `validate_spec` applies to those fields; raises `SpecError` where it
    would. Keeps the validated values read-only (the command a tuple, env and
    resources read-only mappings) and each field's canonical JSON, so a spec
    made from it (`PreparedSpec`) validates and digests only the Run's part.
    A revision never changes, so neither does its template.
    """

    __slots__ = ("_parts", "_values")

    def __init__(self, body: Mapping[str, object]) -> None:
        executor_type = validate_executor_type(body["executor_type"])
        command = validate_command(body["command"])
        cwd = validate_cwd(body["cwd"])
        env = validate_env(body["env"])
        validate_payload_size(command=command, cwd=cwd, env=env, field="spec")
        timeout_s = validate_timeout_s(body["timeout_s"])
        if body["resources"] is None:
            raise SpecError("resources", "is required")
        resources = validate_resources(body["resources"])
        plain: dict[str, object] = {
            "executor_type": executor_type,
            "command": command,
            "cwd": cwd,
            "env": env,
            "timeout_s": timeout_s,
            "resources": resources,
        }
        # canonical_json's key order: each fixed field as its `"key":value`
        # text, each of the Run's fields as its name (filled in per spec).
        self._parts: tuple[str, ...] = tuple(
            f"{encode_basestring(name)}:{_canonical_value(plain[name])}" if name in plain else name
            for name in sorted(SPEC_FIELDS)
        )
        self._values: dict[str, object] = {
            "executor_type": executor_type,
            "command": tuple(command),
            "cwd": cwd,
            "env": MappingProxyType(env),
            "timeout_s": timeout_s,
            "resources": MappingProxyType(resources),
        }

    @classmethod
    def of(cls, definition: TaskDefinition) -> SpecTemplate:
        return cls({name: getattr(definition, name) for name in _BODY_FIELDS})

    def spec(
        self, *, run_id: str, attempt_id: str, project_id: str, task_id: str, task_revision: int
    ) -> PreparedSpec:
        """The Run's spec: its ids validated as `validate_spec` validates them."""
        return PreparedSpec(
            self,
            run_id=run_id,
            attempt_id=attempt_id,
            project_id=project_id,
            task_id=task_id,
            task_revision=task_revision,
        )


class PreparedSpec(Mapping[str, object]):
    """A validated, read-only ExecutionSpec: a `SpecTemplate` and one Run's part.

    The same keys, values and order as `validate_spec(build_spec(...))` (nested
    lists as tuples, objects as read-only mappings, as an offer freezes them),
    and `sha256` is `spec_sha256` of it, computed from the template's canonical
    texts and the Run's ids only. Valid by construction: the ids and
    `task_revision` are checked here, per spec, the rest once per template.
    """

    __slots__ = ("_values", "sha256")

    def __init__(
        self,
        template: SpecTemplate,
        *,
        run_id: str,
        attempt_id: str,
        project_id: str,
        task_id: str,
        task_revision: int,
    ) -> None:
        own: dict[str, object] = {
            "spec_version": SPEC_VERSION,
            "run_id": validate_id(run_id, field="run_id"),
            "attempt_id": validate_id(attempt_id, field="attempt_id"),
            "project_id": validate_id(project_id, field="project_id"),
            "task_id": validate_id(task_id, field="task_id"),
            "task_revision": require_int(
                task_revision, field="task_revision", minimum=1, maximum=2**63 - 1
            ),
        }
        self._values: dict[str, object] = {**own, **template._values}
        # The ids are decimal digits and the integers plain ints: their JSON is
        # the string quoted (as json writes it) and the integer's decimal text.
        text = ",".join(
            part if part not in own else f"{encode_basestring(part)}:{_own_json(own[part])}"
            for part in template._parts
        )
        self.sha256: str = hashlib.sha256(f"{{{text}}}".encode()).hexdigest()

    def __getitem__(self, key: str) -> object:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PreparedSpec(sha256={self.sha256[:12]!r}…)"


def _own_json(value: object) -> str:
    return encode_basestring(value) if isinstance(value, str) else str(value)


def _as_dict(value: object) -> object:
    # Offers keep their spec frozen (MappingProxyType, tuples): json encodes
    # tuples as arrays itself and asks here only for what it cannot encode.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def canonical_json(spec: Mapping[str, object]) -> bytes:
    """The canonical JSON every spec digest is taken over: sorted keys, no
    insignificant whitespace, UTF-8.

    Containers are encoded as they are (a mapping that is not a dict as its
    dict) instead of being copied into plain ones first: every cycle digests
    each offer's spec, and the copy cost more than the encoding (issue #12).
    """
    return json.dumps(
        spec,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
        default=_as_dict,
    ).encode("utf-8")


def spec_sha256(spec: Mapping[str, object]) -> str:
    return hashlib.sha256(canonical_json(spec)).hexdigest()


def validate_payload_size(*, command: object, cwd: object, env: object, field: str) -> None:
    """command + cwd + env within `MAX_SPEC_PAYLOAD_BYTES` of canonical JSON."""
    size = len(canonical_json({"command": command, "cwd": cwd, "env": env}))
    if size > MAX_SPEC_PAYLOAD_BYTES:
        raise SpecError(
            field,
            f"command, cwd and env must total at most {MAX_SPEC_PAYLOAD_BYTES} bytes "
            "of JSON (UTF-8)",
        )


def _max_spec_bytes() -> int:
    # Every field but the payload at its widest, plus the payload cap: an upper
    # bound on len(canonical_json(spec)) of any valid spec.
    widest_id = "9" * MAX_ID_CHARS
    widest: dict[str, object] = {
        "spec_version": SPEC_VERSION,
        **{name: widest_id for name in ID_FIELDS},
        "task_revision": 2**63 - 1,
        "executor_type": "x" * 32,
        "command": [],
        "cwd": None,
        "env": {},
        "timeout_s": MAX_TIMEOUT_S,
        "resources": dict(_RESOURCE_MAX),
    }
    return len(canonical_json(widest)) + MAX_SPEC_PAYLOAD_BYTES


# The most bytes a valid spec's canonical JSON (and so its rendering in a pull
# response, which escapes exactly as canonical_json does) can take.
MAX_SPEC_BYTES: Final = _max_spec_bytes()


def check_spec_identity(
    spec: Mapping[str, object],
    *,
    run_id: str,
    attempt_id: str,
    project_id: str,
    task_id: str,
    task_revision: int,
) -> None:
    """docs/adr/0001 step 5: the spec must describe exactly the persisted candidate."""
    expected: tuple[tuple[str, object], ...] = (
        ("run_id", run_id),
        ("attempt_id", attempt_id),
        ("project_id", project_id),
        ("task_id", task_id),
        ("task_revision", task_revision),
    )
    for name, want in expected:
        got = spec.get(name)
        # type() equality too: 1 == True and "1" != 1 must both count as drift.
        if type(got) is not type(want) or got != want:
            raise SpecError(name, "does not match the persisted candidate")
