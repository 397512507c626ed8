from __future__ import annotations

import pytest

from dispatch.core.budget import HARD_CAPS, BudgetViolation, DispatchBudget, budget_violations


def test_defaults_pass_and_match_the_adr() -> None:
    assert budget_violations({}) == []
    budget = DispatchBudget.from_mapping({})
    assert budget == DispatchBudget()
    assert (budget.recovery_page_size, budget.recovery_max_pages) == (8, 2)
    assert (budget.candidate_page_size, budget.candidate_max_pages) == (8, 2)
    assert (budget.worker_page_size, budget.worker_max_pages) == (8, 2)
    assert budget.max_claim_attempts == 8
    # docs/adr/0005: an Attempt over-delivered three times fails its Run.
    assert (budget.max_deliveries, budget.max_delivery_rounds) == (5, 3)


def test_hard_caps() -> None:
    assert dict(HARD_CAPS) == {
        "page_size": 64,
        "max_pages": 16,
        "worker_total": 64,
        "max_claim_attempts": 64,
    }


def test_values_at_the_caps_pass() -> None:
    at_caps = {
        "recovery_page_size": 64,
        "recovery_max_pages": 16,
        "candidate_page_size": 64,
        "candidate_max_pages": 16,
        "worker_page_size": 64,
        "worker_max_pages": 1,
        "max_claim_attempts": 64,
        "lease_ttl_s": 86400,
        "redelivery_backoff_s": 0,
        "max_deliveries": 100,
        "max_delivery_rounds": 100,
    }
    assert budget_violations(at_caps) == []
    assert DispatchBudget.from_mapping(at_caps).worker_limit == 64


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("recovery_page_size", 65),
        ("recovery_page_size", 0),
        ("recovery_max_pages", 17),
        ("candidate_page_size", 65),
        ("candidate_max_pages", 17),
        ("worker_page_size", 65),
        ("worker_max_pages", 17),
        ("max_claim_attempts", 65),
        ("max_claim_attempts", 0),
        ("lease_ttl_s", 4),
        ("lease_ttl_s", 86401),
        ("redelivery_backoff_s", -1),
        ("redelivery_backoff_s", 3601),
        ("max_deliveries", 0),
        ("max_deliveries", 101),
        ("max_delivery_rounds", 0),
        ("max_delivery_rounds", 101),
    ],
)
def test_each_out_of_range_value_is_a_violation_naming_key_value_and_cap(
    key: str, value: int
) -> None:
    violations = budget_violations({key: value})
    assert key in {v.key for v in violations}
    message = next(v.message for v in violations if v.key == key)
    assert str(value) in message
    assert key in message
    assert str(value) in message
    with pytest.raises(ValueError, match=key):
        DispatchBudget.from_mapping({key: value})


def test_worker_product_over_64_is_a_violation() -> None:
    violations = budget_violations({"worker_page_size": 64, "worker_max_pages": 2})
    assert violations == [
        BudgetViolation(
            "worker_max_pages",
            "worker_page_size \u00d7 worker_max_pages = 128 exceeds the hard cap 64",
        )
    ]


@pytest.mark.parametrize("value", [True, "8", 8.0, None])
def test_non_integer_values_are_violations(value: object) -> None:
    violations = budget_violations({"candidate_page_size": value})
    assert [v.key for v in violations] == ["candidate_page_size"]
    assert "integer" in violations[0].message


def test_unknown_key_is_a_violation() -> None:
    assert [v.key for v in budget_violations({"page_size": 8})] == ["page_size"]


def test_every_violation_is_listed() -> None:
    violations = budget_violations(
        {"recovery_page_size": 100, "max_claim_attempts": 1000, "bogus": 1}
    )
    assert {v.key for v in violations} == {"recovery_page_size", "max_claim_attempts", "bogus"}
    with pytest.raises(ValueError) as err:
        DispatchBudget.from_mapping({"recovery_page_size": 100, "max_claim_attempts": 1000})
    assert "recovery_page_size" in str(err.value)
    assert "max_claim_attempts" in str(err.value)


def test_direct_construction_cannot_bypass_the_caps() -> None:
    with pytest.raises(ValueError, match="worker_page_size"):
        DispatchBudget(worker_page_size=32, worker_max_pages=4)
