"""Offer ids for tests whose agents and spawners run real processes.

The agent finds the processes of an execution box-wide by their
`QL_OFFER_ID` marker (workers.agent.procfs) and ends what carries it.
`./scripts/test` runs two pytest processes side by side on one box, so a
fixed id (the same in both) let one process's test end the other's child.
Every id here starts with a prefix drawn once per test process.
"""

from __future__ import annotations

import secrets

__all__ = ["offer_id"]

_PROCESS = secrets.token_hex(8)


def offer_id(n: int) -> str:
    """The 64-hex-digit offer id number `n` of this test process (ordered as `n`)."""
    return f"{_PROCESS}{n:048x}"
