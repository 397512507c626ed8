"""The strict fields' checks made cheaper keep DRF's answers (issue #12)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.exceptions import NotAcceptable, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BrowsableAPIRenderer
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from qinglong.api_common import JsonFirstNegotiation, StrictCharField
from qinglong.api_renderers import WireJSONRenderer


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


def _negotiated(negotiation: Any, renderers: list[Any], path: str, **meta: str) -> object:
    request = Request(APIRequestFactory().post(path, **meta))
    try:
        renderer, media_type = negotiation.select_renderer(request, renderers)
    except NotAcceptable:
        return "406"
    return type(renderer), media_type


@pytest.mark.parametrize(
    "accept",
    [
        None,
        "",
        "*/*",
        "application/json",
        "application/json; indent=8",
        "application/*",
        "text/html",
        "text/html, application/json;q=0.5",
        "image/png",
    ],
)
@pytest.mark.parametrize("path", ["/api/v1/worker/pull", "/api/v1/worker/pull?format=json"])
@pytest.mark.parametrize("browsable", [False, True], ids=["json", "json+browsable"])
def test_the_json_first_negotiation_answers_what_drf_answers(
    accept: str | None, path: str, browsable: bool
) -> None:
    meta = {} if accept is None else {"HTTP_ACCEPT": accept}
    renderers: list[Any] = [WireJSONRenderer()] + ([BrowsableAPIRenderer()] if browsable else [])
    expected = _negotiated(DefaultContentNegotiation(), renderers, path, **meta)
    assert _negotiated(JsonFirstNegotiation(), renderers, path, **meta) == expected


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
def test_the_usual_accept_is_answered_without_parsing_it(
    accept: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parsed(*args: object) -> None:
        raise AssertionError("the Accept header was parsed")

    monkeypatch.setattr(DefaultContentNegotiation, "_get_parsed_accept_list", parsed)
    meta = {} if accept is None else {"HTTP_ACCEPT": accept}
    chosen = _negotiated(JsonFirstNegotiation(), [WireJSONRenderer()], "/api/v1/runs", **meta)
    assert chosen == (WireJSONRenderer, "application/json")
