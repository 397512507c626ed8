from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import logging
import pickle
from datetime import UTC, datetime, timedelta, timezone

import pytest

from dispatch.core.offer import (
    ClaimedExecutionOffer,
    LeaseGrant,
    OfferSource,
    derive_lease_token,
    offer_id_for,
    token_digest,
    tokens_equal,
)
from dispatch.core.spec import SpecTemplate, build_spec, spec_sha256, validate_task_definition
from dispatch.tests.core._builders import CANARY, SECRET, secret_definition

WHEN = datetime(2026, 7, 18, 12, 0, tzinfo=UTC)
TOKEN = "tok-" + CANARY + "-x" * 10
OFFER_KEY = {
    "attempt_id": "1000",
    "lease_generation": 1,
    "worker_id": "1",
    "session_id": "00000000-0000-4000-8000-000000000001",
    "session_generation": 1,
}


def an_offer(**overrides: object) -> ClaimedExecutionOffer:
    spec = build_spec(
        run_id="100",
        attempt_id="1000",
        project_id="1",
        task_id="10",
        task_revision=1,
        definition=validate_task_definition(secret_definition()),
    )
    fields: dict[str, object] = {
        "offer_id": offer_id_for(**OFFER_KEY),  # type: ignore[arg-type]
        "source": OfferSource.NEW_CLAIM,
        "run_id": "100",
        "attempt_id": "1000",
        "project_id": "1",
        "task_id": "10",
        "task_revision": 1,
        "priority": 5,
        "queued_at": WHEN,
        "worker_id": "1",
        "session_id": OFFER_KEY["session_id"],
        "session_generation": 1,
        "lease": LeaseGrant("5000", 1, TOKEN, WHEN + timedelta(seconds=60)),
        "spec": spec,
        "spec_sha256": spec_sha256(spec),
        "placement_score": 3,
    }
    fields.update(overrides)
    return ClaimedExecutionOffer(**fields)  # type: ignore[arg-type]


def test_offer_id_is_a_stable_sha256_of_its_parts() -> None:
    expected = hashlib.sha256(
        b"ql-offer-v1\x001000\x001\x001\x0000000000-0000-4000-8000-000000000001\x001"
    ).hexdigest()
    assert offer_id_for(**OFFER_KEY) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"attempt_id": "1001"},
        {"lease_generation": 2},
        {"worker_id": "2"},
        {"session_id": "00000000-0000-4000-8000-000000000002"},
        {"session_generation": 2},
    ],
)
def test_offer_id_changes_with_every_part(change: dict[str, object]) -> None:
    assert offer_id_for(**{**OFFER_KEY, **change}) != offer_id_for(**OFFER_KEY)  # type: ignore[arg-type]


def test_offer_id_encoding_is_unambiguous() -> None:
    a = offer_id_for(
        attempt_id="1", lease_generation=12, worker_id="3", session_id="s", session_generation=1
    )
    b = offer_id_for(
        attempt_id="11", lease_generation=2, worker_id="3", session_id="s", session_generation=1
    )
    assert a != b
    with pytest.raises(ValueError):
        offer_id_for(
            attempt_id="1\x002",
            lease_generation=1,
            worker_id="3",
            session_id="s",
            session_generation=1,
        )


def test_lease_token_is_hmac_sha256_base64url_without_padding() -> None:
    offer_id = offer_id_for(**OFFER_KEY)  # type: ignore[arg-type]
    token = derive_lease_token(SECRET, offer_id)
    expected = base64.urlsafe_b64encode(
        hmac.new(SECRET, offer_id.encode(), hashlib.sha256).digest()
    )
    assert token == expected.rstrip(b"=").decode()
    assert len(token) == 43
    assert derive_lease_token(b"other-secret", offer_id) != token
    with pytest.raises(ValueError):
        derive_lease_token(b"", offer_id)


def test_token_digest_and_constant_time_compare() -> None:
    assert token_digest("abc") == hashlib.sha256(b"abc").hexdigest()
    assert tokens_equal("abc", "abc")
    assert not tokens_equal("abc", "abd")
    assert not tokens_equal("雪", "abc")


def test_offer_spec_is_a_read_only_deep_copy() -> None:
    spec = build_spec(
        run_id="100",
        attempt_id="1000",
        project_id="1",
        task_id="10",
        task_revision=1,
        definition=validate_task_definition(secret_definition()),
    )
    offer = an_offer(spec=spec)
    spec["command"].append("rm -rf /")  # type: ignore[attr-defined]
    spec["env"]["API_TOKEN"] = "changed"  # type: ignore[index]
    assert offer.spec["command"] == ("run-job", f"--password={CANARY}")
    assert offer.spec["env"]["API_TOKEN"] == CANARY  # type: ignore[index]
    with pytest.raises(TypeError):
        offer.spec["env"]["X"] = "1"  # type: ignore[index]
    with pytest.raises(TypeError):
        offer.spec["cwd"] = "/"  # type: ignore[index]
    wire = offer.to_wire()
    wire["spec"]["command"].append("x")  # type: ignore[index]
    assert offer.spec["command"] == ("run-job", f"--password={CANARY}")


def test_offer_rejects_a_digest_that_does_not_match_its_spec() -> None:
    with pytest.raises(ValueError, match="spec_sha256"):
        an_offer(spec_sha256="0" * 64)


def test_to_wire_is_the_design_offer_json() -> None:
    offer = an_offer()
    wire = offer.to_wire()
    assert set(wire) == {
        "offer_id", "source", "run_id", "attempt_id", "project_id", "task_id", "task_revision",
        "priority", "queued_at", "worker_id", "session_id", "session_generation", "lease",
        "spec", "spec_sha256", "placement_score",
    }  # fmt: skip
    assert wire["source"] == "new_claim"
    assert wire["queued_at"] == "2026-07-18T12:00:00Z"
    assert wire["lease"] == {
        "lease_id": "5000",
        "generation": 1,
        "token": TOKEN,
        "expires_at": "2026-07-18T12:01:00Z",
    }
    assert isinstance(wire["spec"], dict)
    assert wire["spec"]["command"] == ["run-job", f"--password={CANARY}"]
    assert spec_sha256(wire["spec"]) == wire["spec_sha256"]


def test_to_wire_times_are_utc_even_from_another_offset() -> None:
    plus8 = timezone(timedelta(hours=8))
    wire = an_offer(queued_at=datetime(2026, 7, 18, 20, 0, tzinfo=plus8)).to_wire()
    assert wire["queued_at"] == "2026-07-18T12:00:00Z"


def test_to_wire_refuses_naive_datetimes() -> None:
    with pytest.raises(ValueError):
        an_offer(queued_at=datetime(2026, 7, 18, 12, 0)).to_wire()


def test_offer_repr_str_summary_and_logging_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    offer = an_offer()
    rendered = [
        repr(offer),
        str(offer),
        f"{offer}",
        f"{offer!r}",
        str(offer.summary()),
        repr(offer.lease),
    ]
    with caplog.at_level(logging.INFO):
        logging.getLogger("qinglong.test").info("offer %s %r", offer, offer)
        logging.getLogger("qinglong.test").info("summary %s", offer.summary())
    rendered.append(caplog.text)
    for text in rendered:
        assert CANARY not in text
        assert TOKEN not in text
        assert "run-job" not in text
    assert offer.offer_id in repr(offer)
    assert "token" not in offer.summary()["lease"]  # type: ignore[operator]
    assert "spec" not in offer.summary()


def test_offer_and_lease_refuse_pickle_and_copy() -> None:
    offer = an_offer()
    for thing in (offer, offer.lease):
        with pytest.raises(TypeError):
            pickle.dumps(thing)
        with pytest.raises(TypeError):
            copy.copy(thing)
        with pytest.raises(TypeError):
            copy.deepcopy(thing)


def test_offer_has_no_instance_dict_to_dump() -> None:
    assert not hasattr(an_offer(), "__dict__")


def test_an_offer_of_a_prepared_spec_is_the_offer_of_the_plain_spec() -> None:
    ids = {"run_id": "100", "attempt_id": "1000", "project_id": "1", "task_id": "10"}
    definition = validate_task_definition(secret_definition())
    plain = an_offer()
    prepared = SpecTemplate.of(definition).spec(**ids, task_revision=1)
    offer = an_offer(spec=prepared, spec_sha256=prepared.sha256)
    assert offer.spec_sha256 == plain.spec_sha256
    assert offer.to_wire() == plain.to_wire()
    assert list(offer.to_wire()["spec"]) == list(plain.to_wire()["spec"])  # type: ignore[call-overload]
    assert offer.summary() == plain.summary()
    assert CANARY not in repr(offer) and CANARY not in str(offer.summary())
    # The digest is still checked against the spec.
    with pytest.raises(ValueError, match="spec_sha256"):
        an_offer(spec=prepared, spec_sha256="0" * 64)
