"""Each notebook's parameters cell, rendered from its typed model in ``dsr1kit.params``.

The model is the one place where a default and its help text live. The cell
shows them to a person who opens the notebook, and gives papermill the names
it injects a run's values after. ``dsr1kit parameters-cell`` rewrites the
committed cells after a model changes; a test fails while one differs.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from pydantic import BaseModel

HEADER = (
    "# Parameters (defaults: the tiny CPU set, from dsr1kit.params; "
    "papermill injects a run's values after this cell)."
)
COMMENT_COLUMN = 40  # comments line up here unless the assignment is longer
LINE_WIDTH = 112  # help text wraps onto comment lines below, at the same column
NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def render(model: type[BaseModel]) -> str:
    """`name = default  # help` for every field, grouped by the fields' sections, in model order."""
    rows: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        if name == "notebook":
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "section" in extra:
            rows.append((f"# -- {extra['section']}", ""))
        help_text = field.description or ""
        if "=" in help_text:  # papermill skips a parameter line holding a second '='
            raise ValueError(
                f"{model.__name__}.{name}: help text must not contain '=' (write ':'): {help_text!r}"
            )
        rows.append((_assignment(name, field.get_default(call_default_factory=True)), help_text))
    width = max(len(code) for code, help_text in rows if help_text and len(code) < COMMENT_COLUMN)
    lines = [HEADER]
    for code, help_text in rows:
        if not help_text:
            lines.append(code)
            continue
        first, *rest = code.split("\n")
        column = max(width, len(first))
        wrapped = textwrap.wrap(help_text, max(LINE_WIDTH - column - 4, 30))
        lines.append(f"{first.ljust(column)}  # {wrapped[0]}")
        lines += [f"{' ' * column}  # {more}" for more in wrapped[1:]]
        lines += rest
    return "\n".join(lines)


def _assignment(name: str, value: Any) -> str:
    """`name = literal`; a long list goes one item per line."""
    code = f"{name} = {_literal(value)}"
    if isinstance(value, list) and len(code) > LINE_WIDTH // 2:
        code = "\n".join([f"{name} = ["] + [f"    {_literal(v)}," for v in value] + ["]"])
    return code


def _literal(value: Any) -> str:
    """A Python literal papermill and a reader both understand (repr is exact for these types)."""
    if not isinstance(value, (str, int, float, bool, list, dict)):
        raise TypeError(f"parameter default {value!r} is not a plain literal")
    return repr(value)


def parameters_cell(nb: dict[str, Any]) -> dict[str, Any]:
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"expected one cell tagged 'parameters', found {len(cells)}")
    return cells[0]


def committed_source(path: Path) -> str:
    source = parameters_cell(json.loads(path.read_text()))["source"]
    return "".join(source) if isinstance(source, list) else source


def write(path: Path, model: type[BaseModel]) -> bool:
    """Replace the notebook's parameters cell with the rendering of ``model``; True when it changed."""
    nb = json.loads(path.read_text())
    cell = parameters_cell(nb)
    text = render(model)
    if ("".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]) == text:
        return False
    cell["source"] = text.splitlines(keepends=True)
    cell["outputs"], cell["execution_count"] = [], None
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return True
