"""Building blocks shared by the Worker and the operator APIs.

- `CappedJSONParser`: reads at most the view's byte cap, refuses nesting deeper
  than `MAX_JSON_DEPTH` before parsing (a recursive parser must never hit
  Python's recursion limit: that was a 500), then parses strictly (no
  NaN/Infinity, no duplicate keys: two readers must never disagree on what a
  body says).
- `ApiView`: refuses a body without Content-Length (411) and checks
  Content-Length against the cap before anything else; every response is
  `Cache-Control: no-store`; a JSON-only view answers the usual `Accept`
  (no header, `*/*`, `application/json`) without parsing it (`JsonFirstNegotiation`).
- `StrictSerializer` and strict fields: unknown fields are a 400 (README "Worker API",
  "never silently applied"), and values are never coerced ("5" is not 5).
- `FullMatchRegexValidator` and `QueryIntegerField`: a pattern must match the
  whole value (`$` alone also matches before a trailing newline) and a number
  in a query string is ASCII digits only (`str.isdigit` and `int` also take
  "²" or "٣").
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Mapping
from itertools import accumulate, count
from typing import Any, ClassVar, cast

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import RegexValidator
from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail, ParseError, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.validators import ProhibitSurrogateCharactersValidator
from rest_framework.views import APIView

from qinglong.api_errors import (
    InvalidContentLength,
    LengthRequired,
    NestingTooDeep,
    PayloadTooLarge,
    no_store,
)

# Deepest array/object nesting any API body may have. Ours need 5 (a task
# definition's placement.preferred[i].labels); the limit keeps every recursive reader (the
# JSON parser, serializers, validators, jsonb) far from the recursion limit.
MAX_JSON_DEPTH = 32


def operator_body_limit() -> int:
    return int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError("duplicate key")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


# A JSON string, or an unterminated one up to the end (possessive: no
# backtracking, so the scan stays linear however many quotes a body holds).
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
# Opening brackets step +1, closing ones -1 (as 2 and 0: bytes are unsigned).
_BRACKET_STEPS = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})


def json_nesting_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `text` nests arrays/objects deeper than `limit`, without parsing it.

    Brackets inside strings do not count. Linear and C-speed (regex, translate,
    accumulate): a body of 80 KiB of `[` is refused in milliseconds instead of
    driving `json.loads` into RecursionError.
    """
    if text.count("[") + text.count("{") <= limit:
        return False  # the usual body: nothing to scan
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    steps = brackets.translate(_BRACKET_STEPS).encode("ascii")
    # Depth after the i-th bracket = (sum of steps) - i.
    depth = max(map(operator.sub, accumulate(steps), count(1)), default=0)
    return depth > limit


class CappedJSONParser(JSONParser):
    """JSON parser that never reads more than the view's `max_body_bytes` (+1)."""

    def parse(
        self,
        stream: Any,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        view = (parser_context or {}).get("view")
        limit = getattr(view, "max_body_bytes", None) or operator_body_limit()
        raw = stream.read(limit + 1) if stream is not None else b""
        # Content-Length may lie (or be absent behind a proxy): count what arrives.
        if len(raw) > limit:
            raise PayloadTooLarge()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ParseError() from None
        if json_nesting_exceeds(text):
            raise NestingTooDeep(MAX_JSON_DEPTH)
        try:
            return json.loads(
                text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
            )
        except ValueError:
            raise ParseError() from None
        except RecursionError:  # pragma: no cover - the pre-scan refuses this first
            raise NestingTooDeep(MAX_JSON_DEPTH) from None


# What agents and scripts send: DRF would pick the JSON renderer for each.
# (An empty Accept header is a 406 in DRF: it accepts nothing.)
_JSON_ACCEPTS = frozenset({"*/*", "application/json"})


class JsonFirstNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, minus its Accept parsing when the answer is plain.

    With one renderer, JSON, no query string and no `Accept` header, or `*/*` or
    `application/json`, DRF's answer is always that renderer and its media
    type; every other request (a browser's `text/html`, the browsable API's
    second renderer under DEBUG, a 406) goes through DRF as before. Parsing
    the header and ordering media types by precedence was about 0.05 ms of
    every Worker request (issue #12, bench/request_cost.py).
    """

    def select_renderer(
        self,
        request: Request,
        renderers: Iterable[BaseRenderer],
        format_suffix: str | None = None,
    ) -> tuple[BaseRenderer, str]:
        meta = request.META
        if (
            isinstance(renderers, list)  # as DRF's views pass them
            and len(renderers) == 1
            and renderers[0].media_type == "application/json"
            and format_suffix is None
            and not meta.get("QUERY_STRING")
            and meta.get("HTTP_ACCEPT", "*/*") in _JSON_ACCEPTS
        ):
            return renderers[0], renderers[0].media_type
        chosen: tuple[BaseRenderer, str] = super().select_renderer(
            request, renderers, format_suffix
        )
        return chosen


_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")


class ApiView(APIView):
    """Base view: JSON only, byte-capped bodies."""

    parser_classes = [CappedJSONParser]
    content_negotiation_class = JsonFirstNegotiation
    # Overridden per API; the operator default follows DATA_UPLOAD_MAX_MEMORY_SIZE.
    max_body_bytes: ClassVar[int | None] = None

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Django (WSGI) reads only CONTENT_LENGTH bytes: a chunked body would be
        # parsed as empty and e.g. a heartbeat's `draining: true` silently lost.
        if request.META.get("HTTP_TRANSFER_ENCODING"):
            raise LengthRequired()
        limit = self.max_body_bytes or operator_body_limit()
        raw_length = request.META.get("CONTENT_LENGTH") or "0"
        # ASCII digits only: int() would also read " 12", "1_2" or "١٢".
        if not isinstance(raw_length, str) or _CONTENT_LENGTH.fullmatch(raw_length) is None:
            raise InvalidContentLength()
        length = int(raw_length)
        # Refuse before reading a byte of an announced oversize body.
        if length > limit:
            raise PayloadTooLarge()
        super().initial(request, *args, **kwargs)

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        # Successes and errors alike: offers, session tokens and run details are
        # per-credential answers that no shared cache may keep.
        return no_store(super().finalize_response(request, response, *args, **kwargs))


def unknown_field_error(keys: set[str]) -> ValidationError:
    return ValidationError(
        {key: [ErrorDetail("unknown field", code="unknown_field")] for key in sorted(keys)}
    )


# Every body both APIs read or write is a JSON object: their serializers validate
# or document dicts, never model instances. (DRF's classes are subscriptable at
# runtime, so this is an ordinary base class.)
BodySerializer = serializers.Serializer[dict[str, Any]]


class StrictSerializer(BodySerializer):
    """A request serializer that rejects fields it does not declare."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = {str(key) for key in data} - writable
            if unknown:
                raise unknown_field_error(unknown)
        return super().to_internal_value(data)

    def create(self, validated_data: Any) -> Any:  # pragma: no cover - never saved
        raise NotImplementedError("request serializers only validate; services write")

    def update(self, instance: Any, validated_data: Any) -> Any:  # pragma: no cover
        raise NotImplementedError("request serializers only validate; services write")


_SURROGATE = re.compile("[\ud800-\udfff]")


class _ProhibitSurrogates(ProhibitSurrogateCharactersValidator):
    """DRF's check with DRF's error, by one regex search instead of a Python loop
    calling `ord` on every character (an ACK item's three ids and tokens were
    about 170 calls; issue #12, bench/request_cost.py)."""

    def __call__(self, value: Any) -> None:
        found = _SURROGATE.search(str(value))
        if found is not None:
            message = self.message.format(code_point=ord(found.group()))
            raise ValidationError(message, code=self.code)


class StrictCharField(serializers.CharField):
    """A string, exactly: numbers are not silently turned into text."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)
        self.validators = [
            _ProhibitSurrogates() if type(v) is ProhibitSurrogateCharactersValidator else v
            for v in self.validators
        ]

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class StrictIntegerField(serializers.IntegerField):
    """An integer, exactly: not a bool, a float or a numeric string."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class StrictBooleanField(serializers.BooleanField):
    """true or false, exactly: not 1, "yes" or "true"."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictUUIDField(serializers.UUIDField):
    """A UUID in its string form (README "Worker API": ids are strings)."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid", value="")
        return super().to_internal_value(data)


class FullMatchRegexValidator(RegexValidator):
    """A RegexValidator that requires the whole value to match.

    Django's RegexValidator uses `search`, and `$` also matches just before a
    trailing newline: `^[0-9a-f]{64}$` accepted a digest followed by "\\n".
    The pattern keeps its `^…$` form for the OpenAPI schema (ECMA-262 has no
    `\\Z`); the check here is `fullmatch`.
    """

    def __call__(self, value: Any) -> None:
        regex = cast(re.Pattern[str], self.regex)  # compiled by RegexValidator
        matched = regex.fullmatch(str(value)) is not None
        if matched == self.inverse_match:
            raise DjangoValidationError(self.message, code=self.code, params={"value": value})


# At most 18 digits: every number we read from a query fits a 64-bit column.
_QUERY_INT = re.compile(r"[0-9]{1,18}")


def parse_query_int(raw: object) -> int | None:
    """ASCII decimal digits → int; anything else (signs, spaces, "²", "٣") → None."""
    if isinstance(raw, str) and _QUERY_INT.fullmatch(raw):
        return int(raw)
    return None


class QueryIntegerField(serializers.IntegerField):
    """An integer query parameter: ASCII digits only, never "1.0", " 1" or "\\u0661"."""

    def to_internal_value(self, data: Any) -> int:
        value = parse_query_int(data)
        if value is None:
            self.fail("invalid")
        return value


class StrictChoiceField(serializers.ChoiceField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid_choice", input="")
        return super().to_internal_value(data)


class ErrorSerializer(BodySerializer):
    code = serializers.CharField(help_text="Low-cardinality machine-readable error code.")
    message = serializers.CharField(help_text="Human-readable text; never echoes request values.")


class ErrorEnvelopeSerializer(BodySerializer):
    """`{"error": {"code", "message"}}` — every API failure has this shape."""

    error = ErrorSerializer()


def validated(serializer: type[BodySerializer] | BodySerializer, data: Any) -> dict[str, Any]:
    """Validate a request body; a non-object body is a 400, not a crash.

    Given an instance instead of a class, that instance validates (the same
    checks and errors as `is_valid`, which calls `run_validation` too): one
    instance built at import can serve every request and thread, since
    `run_validation` only reads its bound fields and keeps nothing of the call
    (issue #12: building a serializer per request deep-copies its declared
    fields). Only for serializers whose `validate` keeps no state on `self`.
    """
    if not isinstance(data, Mapping):
        raise ValidationError({"body": [ErrorDetail("must be a JSON object", code="not_object")]})
    if isinstance(serializer, serializers.BaseSerializer):
        return dict(serializer.run_validation(data))
    bound = serializer(data=data)
    bound.is_valid(raise_exception=True)
    return dict(bound.validated_data)
