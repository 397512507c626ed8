from __future__ import annotations

import re

import pytest

from dispatch.core.errors import PlacementError
from dispatch.core.placement import (
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    Placement,
    PreferredTerm,
    normalize_placement,
    placement_score,
    validate_labels,
    validate_placement,
)


def test_absent_placement_is_empty() -> None:
    assert validate_placement(None) == Placement(None, {}, ())


def test_placement_round_trips_through_wire_form() -> None:
    raw = {
        "executor_type": "process",
        "required_labels": {"zone": "a", "k8s.io/arch": "arm64"},
        "preferred": [{"labels": {"disk": "ssd"}, "weight": 10}],
    }
    placement = validate_placement(raw)
    assert placement.preferred == (PreferredTerm({"disk": "ssd"}, 10),)
    assert placement.to_wire() == raw
    assert validate_placement(placement.to_wire()) == placement


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"executor_type": "Docker"}, "placement.executor_type"),
        ({"nodeSelector": {}}, "placement"),
        ({"required_labels": ["zone"]}, "placement.required_labels"),
        ({"required_labels": {"-zone": "a"}}, "placement.required_labels"),
        ({"required_labels": {"zone": "a" * 64}}, "placement.required_labels"),
        ({"required_labels": {"zone": "a\x00"}}, "placement.required_labels"),
        ({"required_labels": {f"k{i}": "v" for i in range(33)}}, "placement.required_labels"),
        ({"preferred": [{"labels": {}, "weight": 1001}]}, "placement.preferred[0].weight"),
        ({"preferred": [{"labels": {}, "weight": True}]}, "placement.preferred[0].weight"),
        ({"preferred": [{"weight": 1}]}, "placement.preferred[0].labels"),
        ({"preferred": [{"labels": {}, "weight": 1, "x": 1}]}, "placement.preferred[0]"),
        ({"preferred": [{"labels": {}, "weight": 1}] * 17}, "placement.preferred"),
        ([], "placement"),
    ],
)
def test_malformed_placement_names_the_field(raw: object, field: str) -> None:
    with pytest.raises(PlacementError) as err:
        validate_placement(raw)
    assert err.value.field == field


CYRILLIC_A = "\u0430"  # looks exactly like the Latin "a"


@pytest.mark.parametrize(
    "labels",
    [
        {"zone": CYRILLIC_A},  # the issue: a required label no Worker can ever match
        {"zone": f"eu-west-{CYRILLIC_A}"},
        {f"zone{CYRILLIC_A}": "a"},
        {"zone": "\uff41"},  # a fullwidth "a"
        {"zone": "a\n"},  # `$` alone matched before a trailing newline
        {"zone\n": "a"},
        {"zone": "a b"},
        {"zone": "a/b"},
        {"zone": "a:b"},
        {"zone": "\u00e9"},
    ],
)
def test_labels_are_ascii_by_the_documented_rule(labels: dict[str, str]) -> None:
    for field, raw in (
        ("labels", labels),
        ("placement.required_labels", {"required_labels": labels}),
        ("placement.preferred[0].labels", {"preferred": [{"labels": labels, "weight": 1}]}),
    ):
        with pytest.raises(PlacementError) as err:
            if field == "labels":
                validate_labels(raw, field=field)
            else:
                validate_placement(raw)
        assert err.value.field == field
        # The rule is named; the value never is.
        assert (LABEL_VALUE_RE in err.value.message) or (LABEL_KEY_RE in err.value.message)
        assert CYRILLIC_A not in str(err.value)


def test_label_values_may_use_the_whole_documented_set() -> None:
    labels = {"zone": "", "arch": "arm64", "pool": "A-b_c.9", "long": "x" * 63}
    assert validate_labels(labels, field="labels") == labels
    assert re.fullmatch(LABEL_VALUE_RE, "eu-West_1.a")


def test_label_error_does_not_echo_key_or_value() -> None:
    with pytest.raises(PlacementError) as err:
        validate_labels({"SECRET-KEY-123": "SECRET-VALUE-456"}, field="labels")
    assert "SECRET" not in str(err.value)


def test_normalize_adds_missing_executor_type_as_required() -> None:
    placement = Placement(None, {"zone": "a"}, ())
    normalized = normalize_placement(placement, "process")
    assert normalized == Placement("process", {"zone": "a"}, ())
    assert placement.executor_type is None


def test_normalize_keeps_an_equal_executor_type() -> None:
    placement = Placement("process", {}, ())
    assert normalize_placement(placement, "process") is placement


def test_normalize_rejects_a_conflicting_executor_type() -> None:
    with pytest.raises(PlacementError) as err:
        normalize_placement(Placement("docker", {}, ()), "process")
    assert (err.value.field, err.value.message) == (
        "placement.executor_type",
        "conflicts with the task's executor type",
    )


PLACEMENT = Placement(
    "process",
    {"zone": "a"},
    (PreferredTerm({"disk": "ssd"}, 10), PreferredTerm({"gpu": "1", "disk": "ssd"}, 5)),
)


@pytest.mark.parametrize(
    ("types", "labels", "score"),
    [
        ({"process"}, {"zone": "a"}, 0),
        ({"process"}, {"zone": "a", "disk": "ssd"}, 10),
        ({"process", "docker"}, {"zone": "a", "disk": "ssd", "gpu": "1"}, 15),
        ({"process"}, {"zone": "a", "gpu": "1"}, 0),
        ({"docker"}, {"zone": "a", "disk": "ssd"}, None),
        ({"process"}, {"zone": "b", "disk": "ssd"}, None),
        ({"process"}, {"disk": "ssd"}, None),
    ],
    ids=[
        "required-only",
        "one-term",
        "all-terms",
        "partial-term",
        "wrong-type",
        "wrong-label",
        "missing-label",
    ],
)
def test_placement_score(types: set[str], labels: dict[str, str], score: int | None) -> None:
    assert placement_score(PLACEMENT, executor_types=types, labels=labels) == score
