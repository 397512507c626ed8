"""The per-cycle budget of `dispatch_once` and its hard caps.

docs/adr/0001: defaults are sized for an edge device; operators may raise them, but
never past the hard caps — throughput comes from more, shorter cycles, not from
bigger ones. A configuration over a cap must stop the process at startup
(`qinglong.checks` turns each violation into a Django system-check Error).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Final

__all__ = [
    "BUDGET_KEYS",
    "BUDGET_RANGES",
    "HARD_CAPS",
    "BudgetViolation",
    "DispatchBudget",
    "budget_violations",
]

HARD_CAPS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "page_size": 64,
        "max_pages": 16,
        # docs/adr/0001: at most 64 Workers take part in one cycle's placement.
        "worker_total": 64,
        "max_claim_attempts": 64,
    }
)


@dataclass(frozen=True)
class BudgetViolation:
    key: str
    message: str


def _violations(values: Mapping[str, object]) -> list[BudgetViolation]:
    found: list[BudgetViolation] = []
    merged: dict[str, object] = {**_DEFAULTS, **values}
    for key in values:
        if key not in BUDGET_RANGES:
            found.append(BudgetViolation(str(key), f"unknown dispatch budget key {key!r}"))
    for key, (minimum, maximum) in BUDGET_RANGES.items():
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int):
            found.append(
                BudgetViolation(key, f"{key} must be an integer (got {type(value).__name__})")
            )
        elif not minimum <= value <= maximum:
            found.append(
                BudgetViolation(
                    key, f"{key} = {value} is outside {minimum}..{maximum} (hard cap {maximum})"
                )
            )
    size, pages = merged["worker_page_size"], merged["worker_max_pages"]
    if (
        isinstance(size, int)
        and isinstance(pages, int)
        and not isinstance(size, bool)
        and not isinstance(pages, bool)
        and size * pages > HARD_CAPS["worker_total"]
    ):
        found.append(
            BudgetViolation(
                "worker_max_pages",
                f"worker_page_size \u00d7 worker_max_pages = {size * pages} "
                f"exceeds the hard cap {HARD_CAPS['worker_total']}",
            )
        )
    return found


@dataclass(frozen=True)
class DispatchBudget:
    recovery_page_size: int = 8
    recovery_max_pages: int = 2
    candidate_page_size: int = 8
    candidate_max_pages: int = 2
    worker_page_size: int = 8
    worker_max_pages: int = 2
    max_claim_attempts: int = 8
    lease_ttl_s: int = 60
    redelivery_backoff_s: int = 5
    max_deliveries: int = 5
    # docs/adr/0005: an Attempt over-delivered this many times fails its Run
    # (`undeliverable`) instead of going back to the queue once more.
    max_delivery_rounds: int = 3

    def __post_init__(self) -> None:
        # Direct construction must not be a way around the hard caps either.
        found = _violations(asdict(self))
        if found:
            raise ValueError(_describe(found))

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> DispatchBudget:
        """Missing keys take their defaults; any violation raises ValueError listing all."""
        found = budget_violations(values)
        if found:
            raise ValueError(_describe(found))
        # Every value was type-checked above; Any only silences the Mapping[str, object].
        kwargs: dict[str, Any] = dict(values)
        return cls(**kwargs)

    @property
    def worker_limit(self) -> int:
        return self.worker_page_size * self.worker_max_pages


def _describe(found: list[BudgetViolation]) -> str:
    return "invalid dispatch budget: " + "; ".join(v.message for v in found)


BUDGET_RANGES: Final[Mapping[str, tuple[int, int]]] = MappingProxyType(
    {
        "recovery_page_size": (1, HARD_CAPS["page_size"]),
        "recovery_max_pages": (1, HARD_CAPS["max_pages"]),
        "candidate_page_size": (1, HARD_CAPS["page_size"]),
        "candidate_max_pages": (1, HARD_CAPS["max_pages"]),
        "worker_page_size": (1, HARD_CAPS["page_size"]),
        "worker_max_pages": (1, HARD_CAPS["max_pages"]),
        "max_claim_attempts": (1, HARD_CAPS["max_claim_attempts"]),
        "lease_ttl_s": (5, 86400),
        "redelivery_backoff_s": (0, 3600),
        "max_deliveries": (1, 100),
        "max_delivery_rounds": (1, 100),
    }
)
BUDGET_KEYS: Final = frozenset(field.name for field in fields(DispatchBudget))
_DEFAULTS: Final[Mapping[str, object]] = MappingProxyType(
    {field.name: field.default for field in fields(DispatchBudget)}
)


def budget_violations(values: Mapping[str, object]) -> list[BudgetViolation]:
    """Every rule the mapping breaks (empty when it is a valid budget)."""
    if not isinstance(values, Mapping):
        return [BudgetViolation("QINGLONG_DISPATCH", "the dispatch budget must be a mapping")]
    return _violations(values)
