"""Placement: which Workers may run a task, and which they should prefer.

docs/adr/0001 steps 6-7: a new claim's Placement must require the candidate's executor
type (added when absent, rejected when conflicting), and Workers are ranked by
the score of the preferred terms they match.

Labels (the one rule, used by Worker enrollment, Session open and every Task
placement term) are ASCII, in the spirit of Kubernetes label syntax:

- key: `[a-z0-9][a-z0-9._/-]{0,62}` (1-63 characters, lowercase);
- value: `[A-Za-z0-9._-]{0,63}` (0-63 characters);
- at most 32 labels per map.

Matching is exact string equality, so a confusable character (a Cyrillic
"\u0430" for a Latin "a") in a required label would make a Run unplaceable forever;
ASCII-only values make that impossible to enter.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Final

from dispatch.core._validate import require_int, require_str, validate_executor_type
from dispatch.core.errors import PlacementError

__all__ = [
    "LABEL_KEY_RE",
    "LABEL_VALUE_RE",
    "MAX_LABELS",
    "MAX_LABEL_VALUE_CHARS",
    "MAX_PREFERRED_TERMS",
    "MAX_WEIGHT",
    "Placement",
    "PreferredTerm",
    "normalize_placement",
    "placement_score",
    "validate_labels",
    "validate_placement",
]

# Checked with fullmatch; the `^…$` form is what error messages and docs show.
LABEL_KEY_RE: Final = r"^[a-z0-9]([a-z0-9._/-]{0,62})$"
LABEL_VALUE_RE: Final = r"^[A-Za-z0-9._-]{0,63}$"
MAX_LABELS: Final = 32
MAX_LABEL_VALUE_CHARS: Final = 63
MAX_PREFERRED_TERMS: Final = 16
MAX_WEIGHT: Final = 1000

_LABEL_KEY = re.compile(LABEL_KEY_RE)
_LABEL_VALUE = re.compile(LABEL_VALUE_RE)
_PLACEMENT_KEYS: Final = frozenset({"executor_type", "required_labels", "preferred"})
_TERM_KEYS: Final = frozenset({"labels", "weight"})


@dataclass(frozen=True)
class PreferredTerm:
    labels: Mapping[str, str]
    weight: int


@dataclass(frozen=True)
class Placement:
    executor_type: str | None
    required_labels: Mapping[str, str] = field(default_factory=dict)
    preferred: tuple[PreferredTerm, ...] = ()

    def to_wire(self) -> dict[str, object]:
        """The Task definition's placement JSON (plain, JSON-able copies)."""
        return {
            "executor_type": self.executor_type,
            "required_labels": dict(self.required_labels),
            "preferred": [
                {"labels": dict(term.labels), "weight": term.weight} for term in self.preferred
            ],
        }


def validate_labels(value: object, *, field: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise PlacementError(field, "must be an object")
    if len(value) > MAX_LABELS:
        raise PlacementError(field, f"must have at most {MAX_LABELS} labels")
    labels: dict[str, str] = {}
    for key, label_value in value.items():
        if not isinstance(key, str) or _LABEL_KEY.fullmatch(key) is None:
            raise PlacementError(field, f"label keys must match {LABEL_KEY_RE}")
        text = require_str(
            label_value, field=field, max_chars=MAX_LABEL_VALUE_CHARS, error=PlacementError
        )
        # Never the value in the message: name the rule (ASCII letters, digits, . _ -).
        if _LABEL_VALUE.fullmatch(text) is None:
            raise PlacementError(field, f"label values must match {LABEL_VALUE_RE}")
        labels[key] = text
    return labels


def _validate_term(value: object, *, field: str) -> PreferredTerm:
    if not isinstance(value, Mapping):
        raise PlacementError(field, "must be an object")
    for key in value:
        if key not in _TERM_KEYS:
            raise PlacementError(field, "has an unknown field")
    if "labels" not in value:
        raise PlacementError(f"{field}.labels", "is required")
    if "weight" not in value:
        raise PlacementError(f"{field}.weight", "is required")
    labels = validate_labels(value["labels"], field=f"{field}.labels")
    weight = require_int(
        value["weight"],
        field=f"{field}.weight",
        minimum=1,
        maximum=MAX_WEIGHT,
        error=PlacementError,
    )
    return PreferredTerm(labels=labels, weight=weight)


def validate_placement(raw: object) -> Placement:
    if raw is None:
        return Placement(executor_type=None, required_labels={}, preferred=())
    if not isinstance(raw, Mapping):
        raise PlacementError("placement", "must be an object")
    for key in raw:
        if key not in _PLACEMENT_KEYS:
            raise PlacementError("placement", "has an unknown field")
    executor_type = raw.get("executor_type")
    if executor_type is not None:
        executor_type = validate_executor_type(
            executor_type, field="placement.executor_type", error=PlacementError
        )
    required_raw = raw.get("required_labels")
    required = (
        {}
        if required_raw is None
        else validate_labels(required_raw, field="placement.required_labels")
    )
    preferred_raw = raw.get("preferred")
    if preferred_raw is None:
        preferred_raw = []
    if not isinstance(preferred_raw, list | tuple):
        raise PlacementError("placement.preferred", "must be a list")
    if len(preferred_raw) > MAX_PREFERRED_TERMS:
        raise PlacementError(
            "placement.preferred", f"must have at most {MAX_PREFERRED_TERMS} terms"
        )
    preferred = tuple(
        _validate_term(term, field=f"placement.preferred[{index}]")
        for index, term in enumerate(preferred_raw)
    )
    return Placement(executor_type=executor_type, required_labels=required, preferred=preferred)


def normalize_placement(placement: Placement, executor_type: str) -> Placement:
    """docs/adr/0001 step 6: a claim's Placement must require the task's executor type."""
    if placement.executor_type is None:
        return Placement(
            executor_type=executor_type,
            required_labels=dict(placement.required_labels),
            preferred=placement.preferred,
        )
    if placement.executor_type != executor_type:
        raise PlacementError("placement.executor_type", "conflicts with the task's executor type")
    return placement


def _labels_match(wanted: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in wanted.items())


def placement_score(
    placement: Placement, *, executor_types: Collection[str], labels: Mapping[str, str]
) -> int | None:
    """None when the Worker is not eligible; else the sum of matched preferred weights."""
    if placement.executor_type is not None and placement.executor_type not in executor_types:
        return None
    if not _labels_match(placement.required_labels, labels):
        return None
    return sum(term.weight for term in placement.preferred if _labels_match(term.labels, labels))
