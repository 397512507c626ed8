"""JSON over HTTP(S) with urllib: the agent's only dependency is the stdlib."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from workers.agent.protocol import Response, TransportError

__all__ = ["HttpTransport"]

# Bigger than any Worker API answer (a pull of a few offers); a larger body is
# not ours and is not parsed.
_MAX_RESPONSE_BYTES = 4 * 1024 * 1024


class HttpTransport:
    def __init__(self, base_url: str, *, timeout_s: float = 15.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("the control plane URL must be http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def post(self, path: str, body: Mapping[str, Any], *, token: str) -> Response:
        request = urllib.request.Request(  # noqa: S310  (scheme checked in __init__)
            self.base_url + path,
            # UTF-8 as is: \uXXXX escapes would blow a legal 64 KiB output
            # tail past the server's body cap.
            data=json.dumps(body, ensure_ascii=False).encode("utf-8"),
            method="POST",
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:  # noqa: S310
                return Response(reply.status, _parse(reply.read(_MAX_RESPONSE_BYTES)))
        except urllib.error.HTTPError as err:
            with err:
                return Response(err.code, _parse(err.read(_MAX_RESPONSE_BYTES)))
        except (urllib.error.URLError, OSError) as err:
            # No status: the request may or may not have arrived.
            raise TransportError(type(err).__name__) from None


def _parse(raw: bytes) -> Mapping[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
