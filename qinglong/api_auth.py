"""Operator API authentication: DRF's Token scheme, read in one statement (issue #12).

`Authorization: Token <key>` exactly as `rest_framework.authentication.
TokenAuthentication` accepts it (same errors, same inactive-user rule). On
PostgreSQL one hand-written statement (`qinglong.rows`, written once) reads
the Token, its User and the User's model permissions — its own and its
Groups', the set `django.contrib.auth.backends.ModelBackend` would read in
two more statements — and the permissions fill the cache `ModelBackend`
keeps on the User (`_perm_cache`), so `OperatorPermission`'s `has_perms`
reads nothing more. A superuser's are left alone: `User.has_perm` answers
yes for an active superuser before asking any backend. SQLite reads as DRF
does.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token

from qinglong.prepared import prepared_cursor
from qinglong.rows import ModelColumns

__all__ = ["OperatorTokenAuthentication"]

_TOKEN = ModelColumns(Token, "t")
_USER = ModelColumns(get_user_model(), "u")
_SQL: dict[str, str] = {}


def _sql() -> str:
    """The Token, its User, and `app_label.codename` of every permission the User
    holds directly or through a Group."""
    found = _SQL.get(connection.vendor)
    if found is not None:
        return found
    qn = connection.ops.quote_name
    user_model = get_user_model()
    own = user_model._meta.get_field("user_permissions").remote_field.through._meta.db_table  # type: ignore[union-attr]
    groups = user_model._meta.get_field("groups").remote_field.through._meta.db_table  # type: ignore[union-attr]
    group_perms = Group._meta.get_field("permissions").remote_field.through._meta.db_table  # type: ignore[union-attr]
    found = _SQL[connection.vendor] = f"""
        SELECT {_TOKEN.select()}, {_USER.select()}, ARRAY(
            SELECT ct.{qn("app_label")} || '.' || p.{qn("codename")}
            FROM {qn(Permission._meta.db_table)} p
            JOIN {qn(ContentType._meta.db_table)} ct ON ct.{qn("id")} = p.{qn("content_type_id")}
            WHERE p.{qn("id")} IN (
                SELECT up.{qn("permission_id")} FROM {qn(own)} up
                WHERE up.{qn("user_id")} = u.{qn("id")}
                UNION
                SELECT gp.{qn("permission_id")} FROM {qn(group_perms)} gp
                JOIN {qn(groups)} ug ON ug.{qn("group_id")} = gp.{qn("group_id")}
                WHERE ug.{qn("user_id")} = u.{qn("id")}
            )
        )
        FROM {qn(Token._meta.db_table)} t
        JOIN {qn(user_model._meta.db_table)} u ON u.{qn("id")} = t.{qn("user_id")}
        WHERE t.{qn("key")} = %s
    """  # noqa: S608  (names from model metadata; values are parameters)
    return found


class OperatorTokenAuthentication(TokenAuthentication):
    """`TokenAuthentication` whose User arrives with its permissions (module docstring)."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        if connection.vendor != "postgresql":
            return super().authenticate_credentials(key)
        # Prepared once per connection (qinglong.prepared): planning it cost
        # PostgreSQL about four times what running it does (issue #12).
        with prepared_cursor() as cursor:
            cursor.execute(_sql(), [key])
            row = cursor.fetchone()
        if row is None:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        width = len(_TOKEN)
        token = _TOKEN.load(row[:width])
        user = _USER.load(row[width : width + len(_USER)])
        token.user = user
        if not user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        if not user.is_superuser:
            # ModelBackend's own cache of get_all_permissions() for this User object.
            user._perm_cache = set(row[-1] or ())  # type: ignore[attr-defined]
        return (user, token)
