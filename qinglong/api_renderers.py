"""The JSON renderer of every API response (REST_FRAMEWORK DEFAULT_RENDERER_CLASSES).

Its own module: `rest_framework.views` imports the renderer setting while it
loads, so the renderer must not import `rest_framework.views` (api_common does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rest_framework.renderers import JSONRenderer


class WireJSONRenderer(JSONRenderer):
    """DRF's JSON renderer without the U+2028/U+2029 escaping, always compact.

    DRF writes both as `\\u2028` (6 bytes instead of 3) so the JSON can be
    pasted into a <script>; API responses never are, and the escape made the
    size of a pull response depend on what a spec holds. Here a string costs
    exactly its canonical-JSON size (`dispatch.core.spec.canonical_json`), which
    is what the pull response budget counts. A client's `indent=N` Accept
    parameter is ignored (it must not grow a response past that budget); only
    the browsable API (DEBUG) asks for indentation, through the context.
    """

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        if data is None:
            return b""
        indent = (renderer_context or {}).get("indent")
        return json.dumps(
            data,
            cls=self.encoder_class,
            indent=indent,
            ensure_ascii=False,
            allow_nan=False,
            separators=(",", ":") if indent is None else (",", ": "),
        ).encode("utf-8")
