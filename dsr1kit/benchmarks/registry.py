"""Which adapter reads a dataset: by its hub repo id first, else by its columns; a schema none reads is
refused, naming its columns and the adapters known, before any server starts or any row is asked."""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from .adapter import Adapter
from .item import Adapted, Exclude, ExcludedRow, Item


class UnknownSchema(ValueError):
    """No adapter reads these columns (or a known repo's rows lack the columns its adapter needs)."""


@lru_cache(maxsize=1)
def adapters() -> tuple[Adapter, ...]:
    from . import gpqa, hle, kit, math_sets, medmcqa, mmlu

    # most specific schemas first: the kit's own (question + answer) reads almost anything, so it is last
    return (
        hle.ADAPTER,
        medmcqa.ADAPTER,
        gpqa.ADAPTER,
        mmlu.PRO,
        mmlu.ADAPTER,
        math_sets.OLYMPIADBENCH,
        math_sets.MATH500,
        math_sets.AIME,
        kit.ADAPTER,
    )


def repo_of(dataset: str) -> str:
    """``org/name`` of a hub dataset spec (``org/name[/config][@split]``), lower case."""
    return "/".join(dataset.partition("@")[0].split("/")[:2]).lower()


def adapter_by_repo(dataset: str) -> Adapter | None:
    """The adapter a hub repo id is known by (``org/name``, config and split ignored), None when none."""
    repo = repo_of(dataset)
    return next((a for a in adapters() if repo in (r.lower() for r in a.repo_ids)), None)


def adapter_for(dataset: str | None, columns: Iterable[str]) -> Adapter:
    columns = sorted(set(columns) - {"_source"})
    known = adapters()
    adapter = adapter_by_repo(dataset) if dataset else None
    if adapter is not None:
        if not adapter.recognises(columns):
            raise UnknownSchema(
                f"{dataset}: the {adapter.name} adapter needs columns "
                f"{adapter.describe_columns()}, the rows have {columns}"
            )
        return adapter
    for adapter in known:
        if adapter.recognises(columns):
            return adapter
    raise UnknownSchema(
        f"{dataset or 'the rows'}: no benchmark adapter reads columns {columns}. Known: "
        + "; ".join(f"{a.name} ({a.describe_columns()})" for a in known)
    )


def read_set(name: str, rows: list[dict[str, Any]]) -> tuple[Adapter, list[Item | ExcludedRow]]:
    """The adapter that reads set ``name`` and, per row in order, its Item or its ExcludedRow."""
    adapter = adapter_for(name, set().union(*(r.keys() for r in rows)))
    out: list[Item | ExcludedRow] = []
    for index, row in enumerate(rows):
        item_id, category = adapter.row_id(row, index), adapter.category_of(row)
        try:
            item = adapter.read(row, item_id)
        except Exclude as why:
            out.append(ExcludedRow(item_id, why.reason, why.detail, name, category))
        else:
            item.category, item.source = category, name
            out.append(item)
    return adapter, out


def adapt(sets: list[tuple[str, list[dict[str, Any]]]]) -> Adapted:
    """Items and excluded rows of several sets (name, rows); ids must be unique across them."""
    items, excluded, chosen, seen = [], [], {}, {}
    for name, rows in sets:
        if not rows:
            continue
        adapter, read = read_set(name, rows)
        chosen[name] = adapter.name
        for row in read:
            (excluded if isinstance(row, ExcludedRow) else items).append(row)
            if row.id in seen:
                raise ValueError(
                    f"id {row.id!r} is in both {seen[row.id]} and {name}; ids must be unique across the "
                    "sets (answers are saved by id)"
                )
            seen[row.id] = name
    out = Adapted(items, excluded, chosen)
    assert out.asked == sum(len(rows) for _, rows in sets), "a row was neither scored nor excluded"
    return out


def training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training rows (``data.plan``'s, each with its ``_source`` name@split) in the kit's schema, read by
    their benchmark's adapter: a MedMCQA row trains as question + lettered options → the answer letter,
    with ``exp`` as the reasoning. A row its adapter excludes stays, without a question, so the encoder
    counts it as skipped for its source; its reason is kept in ``_excluded``."""
    by_source: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_source.setdefault(str(row.get("_source", "")).partition("@")[0], []).append(i)
    out: list[dict[str, Any]] = [{} for _ in rows]
    for name, indices in by_source.items():
        _, read = read_set(name, [rows[i] for i in indices])
        for i, row in zip(indices, read):
            keep = {k: rows[i][k] for k in ("_source",) if k in rows[i]}
            if isinstance(row, ExcludedRow):
                out[i] = {
                    "id": row.id,
                    "_excluded": f"{row.reason}: {row.detail}" if row.detail else row.reason,
                    **keep,
                }
            else:
                out[i] = {**row.to_row(), **keep}
    return out
