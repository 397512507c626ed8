"""Operator API authorization (README "Admin permissions").

The rule lives in `qinglong.api_permissions`, shared by every operator API
(runs, schedules); re-exported here for the views of this package.
"""

from __future__ import annotations

from qinglong.api_permissions import OperatorPermission, permissions_doc

__all__ = ["OperatorPermission", "permissions_doc"]
