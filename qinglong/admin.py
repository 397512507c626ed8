"""Admin-wide hardening, loaded by the admin's autodiscovery (qinglong is an app).

- DRF's TokenProxy admin lists every operator's API key in plaintext (DRF
  stores keys unhashed): it is unregistered, so no admin page ever shows one.
  Tokens are issued with `manage.py drf_create_token USER`.
- `DigestLookupGuard`: the changelist accepts `?field__lookup=` filters on any
  local field, so `?token_digest__startswith=ab` would let a staff user recover
  a full digest one prefix at a time. Any lookup that touches a digest field,
  directly or across a relation, is refused (Django answers 400).
- Permissions: every admin action declares the one permission it needs
  (`@admin.action(permissions=[name])` with `has_<name>_permission`), so
  Django neither offers nor runs it for a user without it; pages whose fields
  are all read-only grant no change permission at all. The table of who may
  do what is in the README ("Admin permissions").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from django.contrib import admin
from django.db.models.constants import LOOKUP_SEP
from django.http import HttpRequest
from rest_framework.authtoken.models import TokenProxy

if TYPE_CHECKING:
    # django-stubs types the admin classes by the model they show, but Django's
    # classes cannot be subscripted at runtime; these bases serve any model.
    ModelAdminBase = admin.ModelAdmin[Any]
    TabularInlineBase = admin.TabularInline[Any, Any]
else:
    ModelAdminBase = admin.ModelAdmin
    TabularInlineBase = admin.TabularInline

# What authenticates a Worker or a lease, or fingerprints a spec: never a filter.
DIGEST_FIELDS: Final = frozenset({"token_digest", "credential_digest", "spec_digest"})


def touches_digest(lookup: str) -> bool:
    return any(part in DIGEST_FIELDS for part in lookup.split(LOOKUP_SEP))


class DigestLookupGuard(ModelAdminBase):
    """A ModelAdmin whose changelist refuses every lookup on a digest field."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        if touches_digest(lookup):
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def get_search_fields(self, request: HttpRequest) -> Any:
        fields = tuple(super().get_search_fields(request))
        # `?q=` matching is a prefix oracle too: drop a digest search field even
        # if one is ever added by mistake.
        return tuple(field for field in fields if not touches_digest(field.lstrip("^=@")))


def holds(request: HttpRequest, permission: str) -> bool:
    """The body of a `has_<name>_permission` method: the user holds `app.codename`."""
    return bool(request.user.has_perm(permission))


class ReadOnlyAdmin(DigestLookupGuard):
    """A view-only console page: state changes only through services (STYLE.md).

    Its actions (each with its own permission) are the only writes. No change
    form either: saving one would write back a whole row read a moment ago over
    whatever a service changed since.
    """

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# `rest_framework.authtoken` comes before `qinglong` in INSTALLED_APPS, so its
# admin module is already imported (and TokenProxy registered) by now.
if admin.site.is_registered(TokenProxy):
    admin.site.unregister(TokenProxy)
