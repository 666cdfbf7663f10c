"""What a benchmark family is to the kit: the repo ids it is known by, the columns of its schema, its reader."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .item import Item


@dataclass(frozen=True)
class Adapter:
    """One benchmark family: the repo ids it is known by, the columns that identify its schema, its reader.

    ``read(row, row_id)`` returns the row's Item or raises ``Exclude`` with the reason it cannot be scored;
    the id is the ``id_key`` column (answers are saved and resumed by it), else the row's place in its set.
    """

    name: str
    repo_ids: tuple[str, ...]
    columns: frozenset[str] | tuple[frozenset[str], ...]  # all of one set (or of one of several sets)
    read: Callable[[dict[str, Any], str], Item]
    protocol: str  # one line: how the benchmark's owners score it and what the kit does
    id_key: str = "id"
    category_key: str = "category"  # the column the per-category table groups by
    default_split: str = "test"  # the split scored when the dataset names none

    def category_of(self, row: dict[str, Any]) -> str:
        value = row.get(self.category_key)
        return str(value) if value not in (None, "") else "all"

    def row_id(self, row: dict[str, Any], index: int) -> str:
        value = row.get(self.id_key, row.get("id"))
        return str(value) if value not in (None, "") else f"row-{index:06d}"

    def recognises(self, columns: Iterable[str]) -> bool:
        have = set(columns)
        return any(need <= have for need in self.column_sets())

    def column_sets(self) -> tuple[frozenset[str], ...]:
        return (self.columns,) if isinstance(self.columns, frozenset) else self.columns

    def describe_columns(self) -> str:
        return " or ".join("+".join(sorted(need)) for need in self.column_sets())
