"""Model instances from hand-written SQL, as the ORM would load them (issue #12).

The hottest reads of the Worker API (the Session token lookup, an ACK's lock
statement) are fixed-shape: compiling them through the ORM on every request
cost about as much CPU as running them. `ModelColumns` writes a model's
select list once and turns its slice of a result row back into an instance
exactly as a queryset does: every field's database converters applied (JSON
decoded, SQLite datetimes parsed, …), `Model.from_db` so the instance is
"from the database" (not `_state.adding`), and fields left out of the select
deferred, so reading one loads it instead of returning a default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Field, Model

__all__ = ["ModelColumns"]

M = TypeVar("M", bound=Model)
_Converter = Callable[[Any, Any, Any], Any]


class ModelColumns(Generic[M]):
    """The columns of `model` under a table alias, and how to load them back."""

    def __init__(self, model: type[M], alias: str, *, only: Iterable[str] | None = None) -> None:
        wanted = None if only is None else set(only)
        self.model = model
        self.alias = alias
        self.fields: list[Field[Any, Any]] = [
            field
            for field in model._meta.concrete_fields
            if wanted is None or field.name in wanted or field.primary_key
        ]
        self._columns = [field.get_col(alias) for field in self.fields]
        self._attnames = [field.attname for field in self.fields]
        self._converters: dict[str, list[tuple[int, Any, list[_Converter]]]] = {}
        self._select: dict[str, str] = {}

    def select(self) -> str:
        """`alias."column", …` in the order `load` expects them (written once per vendor)."""
        found = self._select.get(connection.vendor)
        if found is None:
            qn = connection.ops.quote_name
            prefix = f"{self.alias}." if self.alias else ""  # no alias: a RETURNING list
            found = ", ".join(f"{prefix}{qn(field.column)}" for field in self.fields)
            self._select[connection.vendor] = found
        return found

    def __len__(self) -> int:
        return len(self.fields)

    def _converters_now(self, db: Any) -> list[tuple[int, Any, list[_Converter]]]:
        """(position, column, converters) of each field that has converters on
        `db`'s vendor (the backend adds its own: SQLite parses datetimes);
        fields without any are left as read."""
        vendor = db.vendor
        found = self._converters.get(vendor)
        if found is None:
            found = []
            for position, (field, column) in enumerate(
                zip(self.fields, self._columns, strict=True)
            ):
                converters = [
                    *db.ops.get_db_converters(column),
                    # (not in the stubs) the field's own: JSONField decodes.
                    *cast(Any, field).get_db_converters(db),
                ]
                if converters:
                    found.append((position, column, converters))
            self._converters[vendor] = found
        return found

    @property
    def attnames(self) -> list[str]:
        """The fields' attribute names, in `select` order."""
        return self._attnames

    def load(self, values: Sequence[Any]) -> M:
        """An instance from this model's slice of a row (same order as `select`)."""
        db = connections[DEFAULT_DB_ALIAS]
        return self.model.from_db(db.alias, self._attnames, self.convert(values))

    def convert(self, values: Sequence[Any], db: Any = None) -> list[Any]:
        """This model's slice of a row as `load` hands it to the model: each
        value through its column's converters (same order as `select`); `db`
        the default database's wrapper when the caller has it at hand."""
        if len(values) != len(self._attnames):
            raise ValueError(f"{len(values)} values for {len(self._attnames)} columns")
        # The default database's wrapper itself, looked up once: every attribute
        # read through the `connection` proxy is a thread-local lookup of its
        # own (issue #12: the Session lookup of every Worker request loads two).
        db = db or connections[DEFAULT_DB_ALIAS]
        converted = list(values)
        for position, column, converters in self._converters_now(db):
            value = converted[position]
            for converter in converters:
                value = converter(value, column, db)
            converted[position] = value
        return converted


def load_row(parts: Sequence[ModelColumns[Any]], row: Sequence[Any]) -> tuple[list[Any], int]:
    """One instance per part from a row of their `select()`s side by side, and
    the offset of the first column after them."""
    loaded = []
    offset = 0
    for part in parts:
        loaded.append(part.load(row[offset : offset + len(part)]))
        offset += len(part)
    return loaded, offset
