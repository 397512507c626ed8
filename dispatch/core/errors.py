"""Validation errors of the dispatcher core.

A message names only the field path and the rule that failed, never the offending
value: a task's command, cwd and env may carry secrets (docs/adr/0003: nothing
secret reaches a log or an error body), and these messages end up in both.
"""

from __future__ import annotations

__all__ = ["PlacementError", "SpecError"]


class SpecError(ValueError):
    """A task definition or ExecutionSpec field broke a rule (docs/adr/0001 step 5)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class PlacementError(SpecError):
    """A Placement is malformed or conflicts with the task's executor type.

    docs/adr/0001 step 6.
    """
