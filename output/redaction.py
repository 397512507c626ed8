"""Output is stored redacted of the Task's env values (docs/adr/0006).

Every env value of the Attempt's pinned TaskRevision that is at least
`MIN_REDACTED_CHARS` long is replaced by `REDACTED` before anything is stored:
a live output chunk, the terminal ACK's output tail. Shorter values are left
alone on purpose (like GitLab's minimum for masked variables): masking every
"1" or "on" would make output unreadable and such a value is no secret.

A value can also arrive split across two chunks. `redact_joined` scans the end
of the previous (stored, already redacted) chunk together with the new one,
so a value that straddles the boundary is replaced too: the marker ends the
previous chunk and the rest of the value is cut from the new one.

Plain Python (no Django): the lease authority (ACK tails) and the output
store both use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Final

__all__ = ["MIN_REDACTED_CHARS", "REDACTED", "redact", "redact_joined", "redaction_values"]

REDACTED: Final = "[redacted]"
MIN_REDACTED_CHARS: Final = 4


def redaction_values(env: Mapping[str, object] | None) -> tuple[str, ...]:
    """The values to mask, longest first (a value containing another is masked whole)."""
    if not env:
        return ()
    found = {v for v in env.values() if isinstance(v, str) and len(v) >= MIN_REDACTED_CHARS}
    return tuple(sorted(found, key=lambda v: (-len(v), v)))


@lru_cache(maxsize=128)
def _pattern(values: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first: a regex alternation takes the first alternative that matches.
    return re.compile("|".join(re.escape(v) for v in values))


def redact(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of every value replaced by REDACTED."""
    ordered = tuple(values)
    if not ordered or not text:
        return text
    return _pattern(ordered).sub(REDACTED, text)


def redact_joined(previous: str, text: str, values: Iterable[str]) -> tuple[str, str]:
    """(`previous`, `text`) redacted as if they were one string.

    `previous` is already redacted on its own (a stored chunk); only its last
    `len(longest value) - 1` characters can begin a value that `text`
    finishes. A value that straddles the boundary becomes REDACTED at the end
    of the returned previous part; what remains of it is cut from `text`.
    """
    ordered = tuple(values)
    if not ordered:
        return previous, text
    reach = len(ordered[0]) - 1
    head_len = min(reach, len(previous))
    keep, head = previous[: len(previous) - head_len], previous[len(previous) - head_len :]
    joint = head + text
    boundary = len(head)
    before: list[str] = []
    after: list[str] = []
    position = 0

    def plain(start: int, end: int) -> None:
        if start < boundary:
            before.append(joint[start : min(end, boundary)])
        if end > boundary:
            after.append(joint[max(start, boundary) : end])

    for match in _pattern(ordered).finditer(joint):
        plain(position, match.start())
        # A match that starts before the boundary straddles it (the head alone
        # holds no whole value): its marker belongs to the previous part.
        (before if match.start() < boundary else after).append(REDACTED)
        position = match.end()
    plain(position, len(joint))
    return keep + "".join(before), "".join(after)
