"""The executed notebook made into the report a teammate reads.

In a kernel, every tqdm update and every library warning is its own red stderr box, and paths name the
machine, the account and the virtual environment that ran it. The job log (papermill's ``log_output``)
keeps all of that as text; the report keeps, for each cell that ran through:
- one line per progress bar, its final state, as plain output;
- no warning in the middle: each stderr message goes to one collapsed "Warnings" section at the end
  (count, the cells, the first lines), and the kit's own warnings also to the banner at the top;
- paths written relative to where a reader has them (``runs/…``, ``site-packages/…``, ``~``, ``$TMPDIR``).
A cell that failed keeps its stderr as it ran: there it is the diagnosis, and red means an error.
The banner at the top repeats the verdict the last cell shows, so the outcome is the first thing read.
"""

from __future__ import annotations

import html
import json
import re
import sys
import sysconfig
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# a tqdm line: "desc:  42%|████▏     | 21/50 [..." or, without a total, "desc: 12it [00:01, ..."
_BAR = re.compile(
    r"\d{1,3}%\|.*\|\s*[\d.]+[kMG]?/[\d.]+[kMG]?|\d+(?:\.\d+)?[kMG]?(?:it| ?[A-Za-z]+) \[\d+:\d+"
)
_KIT = re.compile(r"(?:^|/)dsr1kit/[\w/]+\.py:\d+: \w*Warning")  # a warning raised by the kit's own code
_PATH_END = r"(?![\w.-])"  # a prefix ends at a path boundary ("/tmp" is not "/tmpfs")
_SKIP_MIME = ("image/", "application/vnd.jupyter.widget")


def terminal_lines(text: str) -> list[str]:
    """The stream as a terminal shows it: each line's last carriage-return segment, blank lines dropped."""
    out = []
    for raw in text.split("\n"):
        segments = [s for s in raw.split("\r") if s.strip()]
        if segments:
            out.append(segments[-1].rstrip())
    return out


def split_stderr(text: str) -> tuple[list[str], list[str]]:
    """(bars, messages) of a cell's stderr: the final state of each progress bar, and each message (a
    warning's indented source line stays with it)."""
    bars: list[str] = []
    messages: list[str] = []
    for line in terminal_lines(text):
        if _BAR.search(line):
            bars.append(line)
        elif line[:1] in (" ", "\t") and messages:
            messages[-1] += "\n" + line
        else:
            messages.append(line)
    return bars, messages


@dataclass
class MachinePaths:
    """Prefixes that name the machine a run was made on, each with what a reader is shown instead (the
    longest first, so the run folder wins over the temp dir it may live in)."""

    pairs: list[tuple[str, str]]
    _patterns: list[tuple[re.Pattern, str]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for prefix, shown in self.pairs:
            for variant in {prefix.rstrip("/"), str(Path(prefix).resolve()).rstrip("/")}:
                if len(variant) > 1:
                    seen.setdefault(variant, shown)
        self._patterns = [
            (re.compile(re.escape(p) + _PATH_END), shown)
            for p, shown in sorted(seen.items(), key=lambda kv: -len(kv[0]))
        ]

    @classmethod
    def here(cls, run_dir: str | Path) -> "MachinePaths":
        from .paths import PROJECT_ROOT

        run_dir = Path(run_dir).absolute()
        venv = Path(sys.prefix)
        return cls(
            [
                (str(run_dir.parent), run_dir.parent.name),  # …/runs/<id> → runs/<id>
                (sysconfig.get_paths()["purelib"], "site-packages"),
                (str(venv), ".venv" if venv.parent == PROJECT_ROOT else venv.name),
                (str(PROJECT_ROOT), "."),
                (str(Path.home()), "~"),
                (tempfile.gettempdir(), "$TMPDIR"),
            ]
        )

    def __call__(self, text: str) -> str:
        for pattern, shown in self._patterns:
            text = pattern.sub(shown, text)
        return text

    def walk(self, value: Any) -> Any:
        """The same JSON-like value with every string relativized (image data left as it is)."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, dict):
            return {k: v if k.startswith(_SKIP_MIME) else self.walk(v) for k, v in value.items()}
        return value


@dataclass
class Tidied:
    """What tidying moved: every stderr message with the cells it came from, and the bars kept."""

    messages: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)  # first line → cells
    full: dict[str, str] = field(default_factory=dict)  # first line → the whole first message
    bars: int = 0

    def add(self, cell: str, message: str) -> None:
        first = message.splitlines()[0]
        self.messages.setdefault(first, []).append(cell)
        self.full.setdefault(first, message)

    @property
    def kit_warnings(self) -> list[str]:
        return [first for first in self.messages if _KIT.search(first)]


def _cell_label(cell: dict, index: int) -> str:
    count = cell.get("execution_count")
    return f"In [{count}]" if count is not None else f"cell {index}"


def _join(text: str | list[str]) -> str:
    return "".join(text) if isinstance(text, list) else text


def tidy_cells(nb: dict) -> Tidied:
    """Each successful cell's stderr into one line per bar (as plain output) and messages (returned)."""
    tidied = Tidied()
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        outputs = cell.get("outputs", [])
        if any(o.get("output_type") == "error" for o in outputs):
            continue  # a failing cell keeps its stderr: the diagnosis
        kept, stderr, at = [], [], None
        for o in outputs:
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                at = len(kept) if at is None else at
                stderr.append(_join(o.get("text", "")))
            else:
                kept.append(o)
        if at is None:
            continue
        bars, messages = split_stderr("".join(stderr))
        if bars:
            kept.insert(at, {"output_type": "stream", "name": "stdout", "text": "\n".join(bars) + "\n"})
            tidied.bars += len(bars)
        for message in messages:
            tidied.add(_cell_label(cell, index), message)
        cell["outputs"] = kept
    return tidied


def warnings_cell(tidied: Tidied) -> dict:
    """A markdown cell: the stderr messages of the run, collapsed (count, cells, first lines)."""
    n = sum(len(cells) for cells in tidied.messages.values())
    rows = "".join(
        "<tr><td style='text-align:right'>{}</td><td>{}</td><td><pre style='white-space:pre-wrap;margin:0'>{}"
        "</pre></td></tr>".format(len(cells), html.escape(", ".join(OrderedDict.fromkeys(cells))),
                                  html.escape(tidied.full[first][:600]))
        for first, cells in tidied.messages.items()
    )  # fmt: skip
    body = (
        f"<details><summary>{n} message(s) on stderr, {len(tidied.messages)} distinct: library warnings "
        "and logs the run did not act on (the kit's own warnings are also at the top)</summary>"
        f"<table><tr><th>times</th><th>cells</th><th>message</th></tr>{rows}</table></details>"
        if n
        else "No warning or log message on stderr."
    )
    return _markdown(f"## Warnings\n\n{body}", "dsr1kit-warnings")


def banner_cell(summary: dict, status: dict, tidied: Tidied) -> dict | None:
    """The outcome first: the verdict the last cell shows (or where the run failed) and the kit's own
    warnings, as a markdown cell for the top of the report."""
    from .viz import verdict_html

    parts = []
    if summary.get("verdict"):
        parts.append(
            verdict_html(summary["verdict"], [summary.get("headline", ""), *summary.get("verdict_lines", [])])
        )
    elif status.get("status") == "failed":
        failed = status.get("failed_cell") or {}
        where = f"cell {failed.get('execution_count') or failed.get('index')}" if failed else "a cell"
        parts.append(
            verdict_html(
                "failed",
                [f"the run stopped in {where}: {failed.get('ename', '')}: {failed.get('evalue', '')}"],
            )
        )
    if tidied.kit_warnings:
        items = "".join(f"<li><code>{html.escape(w)}</code></li>" for w in tidied.kit_warnings)
        parts.append(f"<div><b>The kit warned</b> (details in Warnings at the end):<ul>{items}</ul></div>")
    return _markdown("\n\n".join(parts), "dsr1kit-banner") if parts else None


def _markdown(source: str, tag: str) -> dict:
    return {"cell_type": "markdown", "metadata": {"tags": [tag]}, "source": source, "id": tag}


def tidy_report(
    ipynb: Path, run_dir: Path, status: dict | None = None, paths: MachinePaths | None = None
) -> Tidied:
    """Rewrite the executed notebook in place as the report (see the module's docstring); returns what moved.
    ``paths``: the run's MachinePaths when the caller has them (else made for ``run_dir``)."""
    nb = json.loads(ipynb.read_text())
    nb["cells"] = [
        c for c in nb.get("cells", []) if not set(c.get("metadata", {}).get("tags", [])) & _OWN_TAGS
    ]
    tidied = tidy_cells(nb)
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    banner = banner_cell(summary, status or {}, tidied)
    if banner is not None:
        first_code = next((i for i, c in enumerate(nb["cells"]) if c.get("cell_type") == "code"), 0)
        nb["cells"].insert(first_code, banner)
    nb["cells"].append(warnings_cell(tidied))
    paths = paths or MachinePaths.here(run_dir)
    ipynb.write_text(json.dumps(paths.walk(nb), indent=1, ensure_ascii=False) + "\n")
    return tidied


_OWN_TAGS = {"dsr1kit-banner", "dsr1kit-warnings"}  # a report tidied before (a rerun) gets them anew
