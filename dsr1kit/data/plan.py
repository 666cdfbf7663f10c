"""Dataset plan: which sources, which splits, how many rows — and a report of what was read.

Two forms, as in the recipe:

- string: ``repo[:limit][@split+split],…`` e.g. ``data/sft_tiny.jsonl:100,org/set@train+test``
  (limit ``ALL`` or empty = every row);
- JSON list: ``[{"name": "org/set", "max_n": 100, "splits": ["train"]}, …]``.

A source is a local file (json, jsonl, parquet), a local folder holding
``<split>.<ext>`` files, or a hub dataset name (clusters only; tests and the
demo use local files). A default split a source does not have (many sets
have no validation split) is skipped and reported; a source or a requested
split that cannot be read is an error naming each one and its reason, since
training on part of the data without noticing is worse than stopping.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..run.paths import resolve

DEFAULT_SPLITS = ("train", "validation", "test")
LOCAL_EXTS = (".jsonl", ".json", ".parquet")
_SOURCE = re.compile(r"^(?P<name>[^:@]+?)(?::(?P<limit>[^@]*))?(?:@(?P<splits>.+))?$")


class DatasetPlanError(ValueError):
    """A plan that cannot be parsed, or that yields no rows."""


@dataclass
class Source:
    name: str
    max_n: int | None = None  # None = all rows
    splits: tuple[str, ...] | None = None  # None = the default splits


@dataclass
class SplitReport:
    source: str
    split: str
    status: str  # "ok" | "skipped"
    rows: int = 0
    reason: str = ""


@dataclass
class LoadedRows:
    rows: list[dict[str, Any]]
    report: list[SplitReport] = field(default_factory=list)


def _limit(raw: Any, where: str) -> int | None:
    if raw is None or (isinstance(raw, str) and raw.strip().upper() in ("", "ALL")):
        return None
    try:
        n = int(raw)
    except (TypeError, ValueError):
        raise DatasetPlanError(
            f"{where}: limit {raw!r} is not a number (use an integer, ALL or nothing)"
        ) from None
    if n < 0:
        raise DatasetPlanError(f"{where}: limit {n} is negative")
    return n


def parse_plan(plan: str) -> list[Source]:
    """Parse either plan form into Sources."""
    text = plan.strip()
    if not text:
        raise DatasetPlanError("empty dataset plan: give e.g. 'data/sft_tiny.jsonl' or 'org/set:1000@train'")
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DatasetPlanError(f"dataset plan looks like JSON but does not parse: {err}") from None
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "name" not in item:
                raise DatasetPlanError(f"dataset plan entry {i} must be an object with a 'name': {item!r}")
            unknown = set(item) - {"name", "max_n", "splits"}
            if unknown:
                raise DatasetPlanError(
                    f"dataset plan entry {i}: unknown keys {sorted(unknown)}; valid: name, max_n, splits"
                )
            splits = item.get("splits")
            if isinstance(splits, str):
                splits = splits.replace("+", ",").split(",")
            out.append(
                Source(
                    item["name"],
                    _limit(item.get("max_n"), item["name"]),
                    tuple(s.strip() for s in splits if s.strip()) if splits else None,
                )
            )
        return out
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _SOURCE.match(part)
        if not m:
            raise DatasetPlanError(f"cannot parse dataset source {part!r}; form: repo[:limit][@split+split]")
        splits = m.group("splits")
        out.append(
            Source(
                m.group("name").strip(),
                _limit(m.group("limit"), part),
                tuple(s.strip() for s in splits.split("+") if s.strip()) if splits else None,
            )
        )
    return out


def _read_local_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"line {i} is not JSON ({err.msg})") from None
        return rows
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):  # {"data": [...]} or {split: [...]}
            data = data.get("data", data)
        if not isinstance(data, list):
            raise ValueError("a .json source must hold a list of objects")
        return data
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    raise ValueError(f"unsupported file type {path.suffix}; use one of {', '.join(LOCAL_EXTS)}")


class MissingSplit(FileNotFoundError):
    """The source has no such split (only skipped when the split was a default, not asked for)."""


def _read_split(source: Source, split: str, explicit: bool) -> list[dict[str, Any]]:
    path = resolve(source.name)
    if path.is_file():
        if explicit and split != "train":
            raise ValueError(f"a single file has no split '{split}' (it is read as 'train')")
        return _read_local_file(path)
    if path.is_dir():
        for ext in LOCAL_EXTS:
            candidate = path / f"{split}{ext}"
            if candidate.is_file():
                return _read_local_file(candidate)
        raise MissingSplit(f"no {split}.jsonl/.json/.parquet in {path}")
    if source.name.startswith((".", "/")) or Path(source.name).suffix in LOCAL_EXTS:
        raise FileNotFoundError(f"local file {source.name} does not exist")
    from datasets import load_dataset  # hub: only reached on clusters

    try:
        return list(load_dataset(source.name, split=split))
    except ValueError as err:
        if "Unknown split" in str(err):
            raise MissingSplit(str(err)) from None
        raise


def load_rows(
    plan: str, default_splits: tuple[str, ...] | list[str] = DEFAULT_SPLITS, sample_limit: int = 0
) -> LoadedRows:
    """Read every source's splits, apply per-source and global limits, report what happened."""
    sources = parse_plan(plan)
    rows: list[dict[str, Any]] = []
    report: list[SplitReport] = []
    broken: list[str] = []
    for source in sources:
        explicit = source.splits is not None
        splits = source.splits if explicit else tuple(default_splits)
        if resolve(source.name).is_file() and not explicit:
            splits = ("train",)
        taken = 0
        for split in splits:
            if source.max_n is not None and taken >= source.max_n:
                break
            try:
                got = _read_split(source, split, explicit)
            except Exception as err:  # noqa: BLE001 - every reader failure is reported with its reason
                reason = f"{type(err).__name__}: {err}"
                report.append(SplitReport(source.name, split, "skipped", 0, reason))
                if isinstance(err, MissingSplit) and not explicit:
                    warnings.warn(f"dataset {source.name}@{split} skipped: {reason}", stacklevel=2)
                else:
                    broken.append(f"{source.name}@{split}: {reason}")
                continue
            if source.max_n is not None:
                got = got[: source.max_n - taken]
            for i, row in enumerate(got):
                row = dict(row)
                row.setdefault("id", f"{source.name}@{split}#{i}")
                row["_source"] = f"{source.name}@{split}"
                rows.append(row)
            taken += len(got)
            report.append(SplitReport(source.name, split, "ok", len(got)))
    if broken:
        raise DatasetPlanError(
            "the dataset plan has sources that cannot be read (training on the rest would "
            "silently use part of the data): "
            + "; ".join(broken)
            + ". Fix each source or remove it from the plan"
        )
    if sample_limit:
        rows = rows[:sample_limit]
    if not rows:
        tried = "; ".join(f"{r.source}@{r.split}: {r.reason or 'no rows'}" for r in report) or plan
        raise DatasetPlanError(f"the dataset plan yielded no rows. Tried: {tried}")
    return LoadedRows(rows, report)
