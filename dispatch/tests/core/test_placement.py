from __future__ import annotations

import pytest

from dispatch.core.errors import PlacementError
from dispatch.core.placement import (
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
