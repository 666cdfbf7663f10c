"""The repository stands alone: no pointer to notes or issue threads a reader does not have, no dead link."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            r"DESIGN" + r"\.md",
            r"RECIPE" + r"\.md",
            r"STYLE" + r"\.md",
            r"\bissue" + r" #?\d",
            r"\.\./shared/",
            r"DESIGN" + r" fact",
        ]
    ),
    re.I,
)


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines() if (ROOT / f).is_file()]


def test_no_reference_to_files_outside_the_repository():
    hits = []
    for path in _tracked():
        if path.suffix in {".png", ".safetensors", ".whl"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [
            f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line)
        ]
    assert not hits, "\n".join(hits)


def test_relative_links_in_readme_and_docs_resolve():
    dead = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                dead.append(f"{doc.relative_to(ROOT)} → {target}")
    assert not dead, dead
