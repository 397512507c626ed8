"""Output is stored redacted of the Task's env values, also when a value is split."""

from __future__ import annotations

import pytest

from output.redaction import REDACTED, redact, redact_joined, redaction_values

SECRET = "s3cr3t-value"
VALUES = redaction_values({"TOKEN": SECRET, "SHORT": "on", "OTHER": "password123"})


def test_values_are_longest_first_and_short_ones_are_left_alone():
    assert redaction_values({"A": "abcd", "B": "abcdef", "C": "on", "D": ""}) == ("abcdef", "abcd")
    assert redaction_values(None) == ()
    assert redaction_values({"N": 12345}) == ()


def test_every_occurrence_is_replaced():
    text = f"token={SECRET} again {SECRET}\npw password123 on"
    assert redact(text, VALUES) == f"token={REDACTED} again {REDACTED}\npw {REDACTED} on"


def test_a_value_containing_another_is_masked_whole():
    values = redaction_values({"A": "abcd", "B": "abcdXYZ"})
    assert redact("..abcdXYZ..abcd..", values) == f"..{REDACTED}..{REDACTED}.."


def test_regex_characters_in_values_are_literal():
    values = redaction_values({"A": "a.b*c(d"})
    assert redact("axbbbcd a.b*c(d", values) == f"axbbbcd {REDACTED}"


@pytest.mark.parametrize("cut", range(1, len(SECRET)))
def test_a_value_split_across_two_chunks_is_redacted(cut):
    previous = redact("line one\nkey=" + SECRET[:cut], VALUES)
    head, rest = redact_joined(previous, SECRET[cut:] + " tail\n", VALUES)
    assert head == f"line one\nkey={REDACTED}"
    assert rest == " tail\n"
    assert SECRET not in head + rest


def test_no_straddle_leaves_both_parts_as_they_were_redacted_alone():
    previous = redact(f"a {SECRET} b s3cr", VALUES)
    head, rest = redact_joined(previous, f"XX {SECRET} c", VALUES)
    assert head == previous
    assert rest == f"XX {REDACTED} c"


def test_without_values_nothing_changes():
    assert redact_joined("abc", "def", ()) == ("abc", "def")
    assert redact("abc", ()) == "abc"
