from __future__ import annotations

import copy
import hashlib
import json
import string
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.core.errors import PlacementError, SpecError
from dispatch.core.placement import Placement
from dispatch.core.spec import (
    DEFAULT_RESOURCES,
    MAX_COMMAND_ITEM_CHARS,
    MAX_COMMAND_ITEMS,
    MAX_ENV_ITEMS,
    SPEC_FIELDS,
    PreparedSpec,
    SpecTemplate,
    build_spec,
    canonical_json,
    check_spec_identity,
    spec_sha256,
    validate_command,
    validate_cwd,
    validate_env,
    validate_executor_type,
    validate_max_attempts,
    validate_resources,
    validate_spec,
    validate_task_definition,
    validate_timeout_s,
)
from dispatch.tests.core._builders import CANARY, definition

IDS = {"run_id": "100", "attempt_id": "1000", "project_id": "1", "task_id": "10"}


def a_spec(**overrides: object) -> dict[str, object]:
    spec = build_spec(task_revision=1, definition=validate_task_definition(definition()), **IDS)
    spec.update(overrides)
    return spec


def field_of(err: pytest.ExceptionInfo[SpecError]) -> str:
    return err.value.field


# ---------------------------------------------------------------- errors


def test_spec_error_str_names_field_and_message() -> None:
    err = SpecError("command[3]", "must be a string")
    assert (err.field, err.message, str(err)) == (
        "command[3]",
        "must be a string",
        "command[3]: must be a string",
    )
    assert isinstance(PlacementError("placement", "x"), SpecError)


# ---------------------------------------------------------------- command


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ([], "command"),
        ("echo hi", "command"),
        (None, "command"),
        (["echo", 3], "command[1]"),
        (["echo", None], "command[1]"),
        ([" "], "command[0]"),
        ([""], "command[0]"),
        (["echo", "a\x00b"], "command[1]"),
        (["x" * (MAX_COMMAND_ITEM_CHARS + 1)], "command[0]"),
        (["echo"] * (MAX_COMMAND_ITEMS + 1), "command"),
        (["echo", *["y" * 4000] * 9], "command"),
    ],
    ids=[
        "empty",
        "string-not-list",
        "none",
        "int-item",
        "none-item",
        "blank-program",
        "empty-program",
        "nul",
        "item-too-long",
        "too-many-items",
        "total-too-long",
    ],
)
def test_bad_command_is_rejected_naming_the_field(value: object, field: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_command(value)
    assert field_of(err) == field


def test_good_command_is_returned_as_a_new_list() -> None:
    raw = ("echo", "", "hi")
    assert validate_command(raw) == ["echo", "", "hi"]


# ---------------------------------------------------------------- env, cwd, scalars


@pytest.mark.parametrize(
    "value",
    [
        {"1BAD": "x"},
        {"BAD-KEY": "x"},
        {"": "x"},
        {"A" * 129: "x"},
        {"OK": 1},
        {"OK": "a\x00"},
        {f"K{i}": "v" for i in range(MAX_ENV_ITEMS + 1)},
        ["A=1"],
    ],
    ids=["digit-first", "dash", "empty", "too-long", "int-value", "nul", "too-many", "list"],
)
def test_bad_env_is_rejected_naming_only_env(value: object) -> None:
    with pytest.raises(SpecError) as err:
        validate_env(value)
    assert field_of(err) == "env"


def test_env_error_never_echoes_the_key_or_value() -> None:
    with pytest.raises(SpecError) as err:
        validate_env({f"{CANARY}-X": CANARY})
    assert CANARY not in str(err.value)
    assert CANARY not in repr(err.value)


@pytest.mark.parametrize(
    "value", ["../etc", "a/../b", "a\\..\\b", "..", "", "a\x00", "x" * 1025, 5]
)
def test_bad_cwd_is_rejected(value: object) -> None:
    with pytest.raises(SpecError) as err:
        validate_cwd(value)
    assert field_of(err) == "cwd"


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("/srv/app", "relative path inside the Worker's work directory"),
        ("/", "relative path"),
        ("//srv", "relative path"),
        ("C:/jobs", "no drive letter"),
        ("c:", "no drive letter"),
        ("a\\b", "'/'"),
        ("\\\\host\\share", "'/'"),
        ("a/b/..", "'..' segment"),
        ("./../x", "'..' segment"),
        ("a/./../../etc", "'..' segment"),
    ],
)
def test_a_cwd_outside_the_work_directory_is_refused_with_a_clear_rule(
    value: str, rule: str
) -> None:
    # The one cwd rule: relative to the Worker's work directory, no escape.
    with pytest.raises(SpecError) as err:
        validate_cwd(value)
    assert field_of(err) == "cwd"
    assert rule in str(err.value)


@pytest.mark.parametrize(
    ("value", "normal"),
    [
        ("app", "app"),
        ("srv/app..v2/./x", "srv/app..v2/x"),
        ("./build//out/", "build/out"),
        (".", "."),
        ("./", "."),
        ("...", "..."),
        ("C-drive/x", "C-drive/x"),
    ],
)
def test_cwd_is_returned_normalized_and_normalizing_is_idempotent(value: str, normal: str) -> None:
    assert validate_cwd(value) == normal
    assert validate_cwd(normal) == normal


def test_cwd_allows_none() -> None:
    assert validate_cwd(None) is None


def test_the_spec_carries_the_normalized_cwd() -> None:
    task = validate_task_definition(definition(cwd="./jobs//nightly/"))
    spec = build_spec(task_revision=1, definition=task, **IDS)
    assert spec["cwd"] == "jobs/nightly"
    assert validate_spec(spec)["cwd"] == "jobs/nightly"


def test_a_spec_with_an_absolute_cwd_fails_validation() -> None:
    # What dispatch does with a stored revision written before the rule.
    with pytest.raises(SpecError) as err:
        validate_spec(a_spec(cwd="/etc"))
    assert field_of(err) == "cwd"


@pytest.mark.parametrize("value", [-1, 0, 604801, True, 1.5, "60"])
def test_bad_timeout_is_rejected(value: object) -> None:
    with pytest.raises(SpecError) as err:
        validate_timeout_s(value)
    assert field_of(err) == "timeout_s"


@pytest.mark.parametrize("value", ["", "Process", "1proc", "a" * 33, "pro cess", "proc\n", None, 3])
def test_bad_executor_type_format_is_rejected(value: object) -> None:
    with pytest.raises(SpecError) as err:
        validate_executor_type(value)
    assert field_of(err) == "executor_type"


def test_executor_type_field_name_is_configurable() -> None:
    with pytest.raises(SpecError) as err:
        validate_executor_type("BAD", field="executor_types[2]")
    assert field_of(err) == "executor_types[2]"


@pytest.mark.parametrize(
    ("value", "ok"), [(1, True), (100, True), (0, False), (101, False), (True, False)]
)
def test_max_attempts_range(value: object, ok: bool) -> None:
    if ok:
        assert validate_max_attempts(value) == value
    else:
        with pytest.raises(SpecError):
            validate_max_attempts(value)


def test_resources_default_and_partial() -> None:
    assert validate_resources(None) == {"cpu_millis": 1000, "memory_mb": 256}
    assert validate_resources({"memory_mb": 512}) == {"cpu_millis": 1000, "memory_mb": 512}
    result = validate_resources(None)
    result["cpu_millis"] = 1
    assert DEFAULT_RESOURCES["cpu_millis"] == 1000


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"gpu": 1}, "resources"),
        ({"cpu_millis": -1}, "resources.cpu_millis"),
        ({"cpu_millis": 1_000_001}, "resources.cpu_millis"),
        ({"memory_mb": True}, "resources.memory_mb"),
        ({"memory_mb": 10_000_001}, "resources.memory_mb"),
        ([1], "resources"),
    ],
)
def test_bad_resources_are_rejected(value: object, field: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_resources(value)
    assert field_of(err) == field


# ---------------------------------------------------------------- task definition


def test_task_definition_defaults_and_added_placement() -> None:
    task = validate_task_definition({"executor_type": "process", "command": ["true"]})
    assert task.cwd is None
    assert task.env == {}
    assert task.timeout_s == 3600
    assert task.max_attempts == 1
    assert task.resources == {"cpu_millis": 1000, "memory_mb": 256}
    assert task.placement == Placement("process", {}, ())


def test_task_definition_rejects_unknown_field_by_name() -> None:
    with pytest.raises(SpecError) as err:
        validate_task_definition({**definition(), "shell": True})
    assert (err.value.field, err.value.message) == ("shell", "unknown field")


def test_task_definition_unknown_field_that_looks_like_data_is_not_echoed() -> None:
    with pytest.raises(SpecError) as err:
        validate_task_definition({**definition(), f"{CANARY} secret": 1})
    assert err.value.field == "definition"
    assert CANARY not in str(err.value)


@pytest.mark.parametrize("missing", ["executor_type", "command"])
def test_task_definition_requires_field(missing: str) -> None:
    raw = definition()
    del raw[missing]
    with pytest.raises(SpecError) as err:
        validate_task_definition(raw)
    assert err.value.field == missing


def test_task_definition_rejects_conflicting_placement_executor() -> None:
    with pytest.raises(PlacementError) as err:
        validate_task_definition(definition(placement={"executor_type": "docker"}))
    assert err.value.field == "placement.executor_type"


@pytest.mark.parametrize(
    ("placement", "field"),
    [
        ("zone=a", "placement"),
        ({"zone": "a"}, "placement"),
        ({"required_labels": {"Zone": "a"}}, "placement.required_labels"),
        ({"required_labels": {"zone": 1}}, "placement.required_labels"),
        ({"preferred": [{"labels": {"zone": "a"}, "weight": 0}]}, "placement.preferred[0].weight"),
        ({"preferred": [{"labels": {"zone": "a"}}]}, "placement.preferred[0].weight"),
        ({"preferred": {"labels": {}}}, "placement.preferred"),
    ],
)
def test_malformed_placement_is_rejected_naming_the_field(placement: object, field: str) -> None:
    with pytest.raises(PlacementError) as err:
        validate_task_definition(definition(placement=placement))
    assert err.value.field == field


def test_task_definition_repr_hides_command_env_and_cwd() -> None:
    task = validate_task_definition(
        definition(command=["x", CANARY], env={"K": CANARY}, cwd=f"srv/{CANARY}")
    )
    assert CANARY not in repr(task)


def test_definition_round_trips_through_placement_wire_form() -> None:
    task = validate_task_definition(
        definition(
            placement={
                "required_labels": {"zone": "a"},
                "preferred": [{"labels": {"gpu": "1"}, "weight": 5}],
            }
        )
    )
    again = validate_task_definition(definition(placement=task.placement.to_wire()))
    assert again.placement == task.placement


# ---------------------------------------------------------------- spec


def test_build_spec_has_exactly_the_spec_fields() -> None:
    spec = a_spec()
    assert set(spec) == SPEC_FIELDS
    assert spec["spec_version"] == 1
    assert spec["command"] == ["echo", "hello"]


def test_validate_spec_strips_unknown_fields() -> None:
    cleaned = validate_spec({**a_spec(), "debug": True, "secret_sauce": {"x": 1}})
    assert set(cleaned) == SPEC_FIELDS


def test_validate_spec_returns_a_deep_copy() -> None:
    raw = a_spec()
    cleaned = validate_spec(raw)
    raw["command"].append("rm")  # type: ignore[attr-defined]
    raw["env"]["GREETING"] = "changed"  # type: ignore[index]
    assert cleaned["command"] == ["echo", "hello"]
    assert cleaned["env"] == {"GREETING": "hi"}


@pytest.mark.parametrize("missing", sorted(SPEC_FIELDS))
def test_validate_spec_requires_every_field(missing: str) -> None:
    raw = a_spec()
    del raw[missing]
    with pytest.raises(SpecError) as err:
        validate_spec(raw)
    assert err.value.field == missing


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"spec_version": 2}, "spec_version"),
        ({"spec_version": True}, "spec_version"),
        ({"run_id": 100}, "run_id"),
        ({"attempt_id": ""}, "attempt_id"),
        ({"project_id": "1a"}, "project_id"),
        ({"task_id": "1" * 21}, "task_id"),
        ({"task_id": "١٢"}, "task_id"),
        ({"task_revision": 0}, "task_revision"),
        ({"task_revision": True}, "task_revision"),
        ({"timeout_s": -5}, "timeout_s"),
        ({"command": []}, "command"),
        ({"cwd": "../x"}, "cwd"),
        ({"resources": None}, "resources"),
        ({"executor_type": "Bad"}, "executor_type"),
    ],
)
def test_validate_spec_rejects_bad_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_spec(a_spec(**overrides))
    assert err.value.field == field


def test_spec_identity_mismatch_names_first_field() -> None:
    spec = a_spec()
    check_spec_identity(spec, task_revision=1, **IDS)
    with pytest.raises(SpecError) as err:
        check_spec_identity(spec, task_revision=2, **IDS)
    assert (err.value.field, err.value.message) == (
        "task_revision",
        "does not match the persisted candidate",
    )
    with pytest.raises(SpecError) as err:
        check_spec_identity(spec, task_revision=1, **{**IDS, "attempt_id": "1001"})
    assert err.value.field == "attempt_id"


def test_spec_identity_rejects_bool_revision() -> None:
    with pytest.raises(SpecError):
        check_spec_identity(a_spec(task_revision=True), task_revision=1, **IDS)


def test_canonical_json_matches_the_documented_vector() -> None:
    spec = a_spec(env={"B": "ü", "A": "雪"})
    expected = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )
    assert canonical_json(spec) == expected
    assert spec_sha256(spec) == hashlib.sha256(expected).hexdigest()
    assert b'"env":{"A":"\xe9\x9b\xaa","B":"\xc3\xbc"}' in canonical_json(spec)


# ---------------------------------------------------------------- properties

_text = st.text(alphabet=string.ascii_letters + string.digits + " -_/äé雪", max_size=20)
_digits = st.from_regex(r"[0-9]{1,20}", fullmatch=True)
_specs = st.fixed_dictionaries(
    {
        "spec_version": st.just(1),
        "run_id": _digits,
        "attempt_id": _digits,
        "project_id": _digits,
        "task_id": _digits,
        "task_revision": st.integers(1, 10**9),
        "executor_type": st.from_regex(r"[a-z][a-z0-9_.-]{0,31}", fullmatch=True),
        "command": st.lists(_text, min_size=1, max_size=5).filter(lambda c: c[0].strip() != ""),
        "cwd": st.none() | st.just("srv/app"),
        "env": st.dictionaries(
            st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True), _text, max_size=5
        ),
        "timeout_s": st.integers(1, 604800),
        "resources": st.fixed_dictionaries(
            {"cpu_millis": st.integers(0, 1_000_000), "memory_mb": st.integers(0, 10_000_000)}
        ),
    },
    optional={"extra": st.integers(), "other": _text},
)


@settings(database=None, max_examples=80, deadline=None)
@given(_specs)
def test_validate_spec_is_idempotent(raw: dict[str, object]) -> None:
    once = validate_spec(raw)
    assert validate_spec(once) == once
    assert set(once) == SPEC_FIELDS


@settings(database=None, max_examples=80, deadline=None)
@given(_specs, st.randoms(use_true_random=False))
def test_spec_sha_is_stable_under_key_reordering(raw: dict[str, object], rnd: object) -> None:
    spec = validate_spec(raw)
    keys = list(spec)
    rnd.shuffle(keys)  # type: ignore[attr-defined]
    reordered = {key: copy.deepcopy(spec[key]) for key in keys}
    env = reordered["env"]
    assert isinstance(env, dict)
    reordered["env"] = dict(reversed(list(env.items())))
    assert spec_sha256(reordered) == spec_sha256(spec)


@settings(database=None, max_examples=60, deadline=None)
@given(st.integers(0, 5), st.sampled_from(["too-long", "nul", "not-str"]))
def test_command_errors_never_echo_the_value(index: int, kind: str) -> None:
    command: list[object] = ["echo"] * 6
    command[index] = {
        "too-long": CANARY * 1000,
        "nul": f"{CANARY}\x00",
        "not-str": {CANARY: CANARY},
    }[kind]
    with pytest.raises(SpecError) as err:
        validate_command(command)
    assert CANARY not in str(err.value)
    assert err.value.field == f"command[{index}]"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"command": ["echo", "x\ud800"]}, "command[1]"),
        ({"env": {"API_KEY": "hunter2\udfff"}}, "env"),
        ({"cwd": "srv/\ud800"}, "cwd"),
        ({"placement": {"required_labels": {"zone": "a\ud800"}}}, "placement.required_labels"),
    ],
)
def test_lone_surrogates_are_rejected_before_anything_is_hashed(override, field) -> None:
    raw = {"executor_type": "process", "command": ["echo", "hi"], **override}
    with pytest.raises(SpecError) as err:
        validate_task_definition(raw)
    assert err.value.field.startswith(field.split("[")[0])
    assert "\ud800" not in str(err.value) and "hunter2" not in str(err.value)


# ------------------------------------------------ a revision's spec, validated once

_RUN_PART = ("run_id", "attempt_id", "project_id", "task_id", "task_revision")


def _prepared(raw: dict[str, object]) -> PreparedSpec:
    return SpecTemplate(raw).spec(**{name: raw[name] for name in _RUN_PART})  # type: ignore[arg-type]


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _same_as_validated(raw: dict[str, object]) -> None:
    plain = validate_spec(raw)
    prepared = _prepared(raw)
    assert _plain(prepared) == plain
    assert list(prepared) == list(plain)
    assert canonical_json(prepared) == canonical_json(plain)
    assert prepared.sha256 == spec_sha256(prepared) == spec_sha256(plain)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cwd": None, "env": {}},
        {"command": ['say "hi"', "back\\slash", "new\nline", "tab\tand\x7f"]},
        {"command": ["雪", "äé", "emoji 🚀", "line\u2028sep"], "cwd": "srv/雪"},
        {"env": {"Z": "last", "A": "first", "M": '{"json":[1,2]}', "B": ""}},
        {"resources": {"cpu_millis": 0, "memory_mb": 10_000_000}, "timeout_s": 604800},
        {"run_id": "9" * 20, "attempt_id": "0", "task_revision": 2**63 - 1},
    ],
)
def test_a_prepared_spec_is_the_validated_spec_and_its_digest(overrides: dict[str, object]) -> None:
    _same_as_validated(a_spec(**overrides))


@settings(database=None, max_examples=80, deadline=None)
@given(_specs)
def test_a_prepared_spec_is_the_validated_spec_for_any_spec(raw: dict[str, object]) -> None:
    _same_as_validated(raw)


def test_a_prepared_spec_is_read_only_and_shares_nothing_with_its_body() -> None:
    raw = a_spec()
    prepared = _prepared(raw)
    env, command = raw["env"], raw["command"]
    assert isinstance(env, dict) and isinstance(command, list)
    env["GREETING"] = "changed"
    command.append("more")
    assert _plain(prepared) == validate_spec(a_spec())
    with pytest.raises(TypeError):
        prepared["env"]["GREETING"] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        prepared["run_id"] = "1"  # type: ignore[index]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("command", []),
        ("env", {"1BAD": "x"}),
        ("cwd", "/abs"),
        ("timeout_s", 0),
        ("resources", None),
        ("executor_type", "Bad"),
        ("env", {"BIG": "x" * 70_000}),
    ],
)
def test_a_template_refuses_a_body_as_validate_spec_does(field: str, value: object) -> None:
    raw = a_spec(**{field: value})
    with pytest.raises(SpecError) as plain:
        validate_spec(raw)
    with pytest.raises(SpecError) as template:
        SpecTemplate(raw)
    assert str(template.value) == str(plain.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run_id", "1a"),
        ("attempt_id", ""),
        ("task_id", 10),
        ("task_revision", 0),
        ("task_revision", True),
    ],
)
def test_a_prepared_spec_checks_its_runs_part_as_validate_spec_does(
    field: str, value: object
) -> None:
    raw = a_spec(**{field: value})
    with pytest.raises(SpecError) as plain:
        validate_spec(raw)
    with pytest.raises(SpecError) as prepared:
        _prepared(raw)
    assert str(prepared.value) == str(plain.value)
