"""JSON over HTTP(S) with urllib: the agent's only dependency is the stdlib.

Every request carries a Bearer secret (the Worker credential or the Session
token), so the transport never lets it travel anywhere but the configured
control plane:

- redirects are never followed: urllib would re-send the Authorization header
  to whatever host a 3xx names; a 3xx comes back as a plain non-2xx Response
  and the agent treats it as a refusal (e.g. a 3xx on `starting`: run nothing);
- plain `http://` is accepted only for a loopback host (the embedded default,
  `./scripts/dev`); anything else must be `https://`.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import IO, Any, NoReturn

from workers.agent.protocol import Response, TransportError

__all__ = ["HttpTransport", "is_loopback_host"]

# Bigger than any Worker API answer (a pull of a few offers); a larger body is
# not ours and is not parsed.
_MAX_RESPONSE_BYTES = 4 * 1024 * 1024


def is_loopback_host(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: traffic that never leaves the box."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Never follow a 3xx: following would re-send the Bearer secret elsewhere."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> NoReturn:
        # urllib turns this into the HTTPError that `post` maps to a Response.
        raise urllib.error.HTTPError(req.full_url, code, msg, headers, fp)


class HttpTransport:
    def __init__(self, base_url: str, *, timeout_s: float = 15.0) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the control plane URL must be http:// or https://")
        if parts.scheme == "http" and not is_loopback_host(parts.hostname):
            # A Bearer secret in clear text over a network: refuse, don't warn.
            raise ValueError("a non-loopback control plane URL must be https://")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(_RefuseRedirects())

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
            with self._opener.open(request, timeout=self.timeout_s) as reply:
                return Response(reply.status, _parse(reply.read(_MAX_RESPONSE_BYTES)))
        except urllib.error.HTTPError as err:
            with err:
                if 300 <= err.code < 400:
                    # A redirect's body is not the control plane's answer.
                    return Response(err.code, {})
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
