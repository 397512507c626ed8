"""The strict fields' checks made cheaper keep DRF's answers (issue #12)."""

from __future__ import annotations

import pytest
from rest_framework.exceptions import ValidationError
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from qinglong.api_common import StrictCharField


def _refusal(validator: object, value: str) -> list[tuple[str, str]] | None:
    try:
        validator(value)  # type: ignore[operator]
    except ValidationError as err:
        return [(str(detail), detail.code) for detail in err.detail]  # type: ignore[union-attr]
    return None


@pytest.mark.parametrize(
    "value",
    ["", "pid:42", "a" * 64, "ok 😀 雪", "\ud800", "x\udfffy", "a\ud83d\ude00b", "\udbff\ud800"],
)
def test_the_surrogate_check_refuses_exactly_what_drf_refuses_with_its_message(value: str) -> None:
    field = StrictCharField()
    [fast] = [v for v in field.validators if isinstance(v, ProhibitSurrogateCharactersValidator)]
    assert type(fast) is not ProhibitSurrogateCharactersValidator
    assert _refusal(fast, value) == _refusal(ProhibitSurrogateCharactersValidator(), value)
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        assert _refusal(fast, value) is not None
