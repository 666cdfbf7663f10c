"""The repository stands alone: no pointer to notes or issue threads a reader does not have, no dead link."""

from __future__ import annotations

import json
import re
import statistics
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


NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _source(path: str, pattern: str) -> str:
    """The one value `pattern`'s group finds in the file at `path` (a test's tolerance, a threshold)."""
    (value,) = set(re.findall(pattern, (ROOT / path).read_text(), re.M))
    return value


def test_readme_figures_equal_their_sources():
    """The README's figures read from what states them: a test's own tolerance or a committed result file.
    A re-measured file or a changed tolerance without the README following fails here, naming the figure."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    results = ROOT / "docs" / "results"

    def load(name: str) -> dict:
        return json.loads((results / name).read_text())

    # each section the README cites as a source is there (a heading's GitHub anchor)
    for target, anchor in re.findall(r"\]\(([^)#\s]+)#([^)]+)\)", (ROOT / "README.md").read_text()):
        headings = re.findall(r"^#+ (.+)$", (ROOT / target).read_text(), re.M)
        anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        assert anchor in anchors, f"README links {target}#{anchor}: no such heading"

    said = []  # phrases the README must hold, each built from its source
    # what the tests hold
    fast_vs_naive = _source("tests/test_train_hari_loss.py", r"g_naive.norm\(\)\) < (\S+)$")
    said.append(f"within {fast_vs_naive} relative in fp32")
    cosine = _source("tests/test_gpu_paths.py", r"cosine >= ([0-9.]+),")
    said.append(f"cosine ≥ {cosine} in bf16")
    cached_vs_uncached = _source("tests/test_train_prefix.py", r"^TOLERANCE = (\S+)$")
    said.append(f"The adapter is the uncached one (relative difference ≤ {cached_vs_uncached} in fp32")
    margin = float(_source("tests/test_demo.py", r"[+-] (0\.\d+)$"))
    said.append(f"B gains and A loses more than {margin * 100:.0f} points each")
    browser = (ROOT / "tests/test_cli_lab_browser.py").read_text()
    opened = set(re.findall(r'open_and_run_all\(page, lab, "(\w+)"', browser))
    assert opened == {nb.stem for nb in (ROOT / "notebooks").glob("*.ipynb")}, opened
    said.append(f"for all {NUMBERS[len(opened)]} notebooks")
    gpu_paragraph = re.search(r"Tests marked `gpu`.*?\n\n", (ROOT / "README.md").read_text(), re.S).group(0)
    for name in re.findall(r"tests/\w+\.py", gpu_paragraph):
        assert "pytest.mark.gpu" in (ROOT / name).read_text(), f"README names {name} among the gpu tests"

    # the HARI step against the field's recipe, and the cached step at R1's widths (H200)
    rows = {r["layers"]: r for r in load("hari_recipe_baseline.h200.json")["results"]}
    (above,) = {r["rows"]["fast"]["peak_above_model_gib"] for r in rows.values()}
    said.append(
        f"a step is {rows[8]['fast_vs_field_recipe_x']:.1f}× faster at 8 layers and "
        f"{rows[16]['fast_vs_field_recipe_x']:.1f}× at 16, with a peak of {above:.2f} GiB above the model at "
        f"both depths; against the same two full forwards in bf16 it is {rows[8]['fast_vs_bf16_recipe_x']:.1f}× "
        f"and {rows[16]['fast_vs_bf16_recipe_x']:.1f}× faster"
    )
    cached = load("hari_cached.h200.json")
    (bf16,) = [r for r in cached["cached"] if r["experts"] == "bf16"]
    said.append(
        f"a cached step runs {bf16['tokens_per_s']:,.0f} tokens/s on one H200 (bf16 last layer, "
        f"{bf16['peak_gib']:.1f} GiB peak), against {cached['earlier_61_layer']['tokens_per_s_per_gpu']:.0f} "
        "tokens/s per GPU for the 61-layer step"
    )

    # the cached step on H100s: the reference read from its cache, then the kit's experts forward
    def timed(name: str) -> dict:
        return load(name)["summary"]["timed_without_profiler"]

    speedups = [timed(f"cached_profile_reference_cached.{e}.h100.json")["reference"] for e in ("bf16", "nf4")]
    said.append(
        f"step {speedups[0]['fused_speedup']:.2f}× faster with bf16 experts and "
        f"{speedups[1]['fused_speedup']:.2f}× with NF4 experts"
    )
    # The default step (reference from its cache, the kit's experts): the first machine timed it once (its
    # reference comparison ran transformers' experts forward), each call on the second machine twice.
    default = [timed("cached_profile_kit_experts.bf16.h100.json")["experts"]["kit"]["tokens_per_s"]]
    for run in ("run2", "run3"):
        both = timed(f"cached_profile_kit_experts.bf16.h100.{run}.json")
        default += [both["reference"]["cached"]["tokens_per_s"], both["experts"]["kit"]["tokens_per_s"]]
    said.append(
        f"the bf16 step then runs {statistics.median(default) / 1000:.1f}k tokens/s (the median of "
        f"{NUMBERS[len(default)]} timings on two H100s)"
    )
    nf4 = [
        timed(name)["reference"]["cached"]["tokens_per_s"] / 1000
        for name in (
            "cached_profile_reference_cached.nf4.h100.json",
            "cached_profile_kit_experts.nf4.h100.run2.json",
        )
    ]
    said.append(f"the NF4 step runs {min(nf4):.1f}–{max(nf4):.1f}k")

    # the demo across builds of the tiny model (CPU)
    spread = load("demo_spread.cpu.json")
    builds = [b["build_s"] for b in spread["epochs_3_before_the_build_check"] if "build_s" in b]
    said.append(f"({min(builds):.0f}–{max(builds):.0f} s a build in")
    # a build the build's own check keeps knows task A (it asks ≥ 90% on each pre-training task)
    kept = [r for r in spread["epochs_6"] if r["base task A"] >= 0.9]

    def pct(key: str) -> str:
        values = sorted(round(r[key] * 100) for r in kept)
        return f"{values[0]}–{values[-1]}%"

    seeds = [str(r["seed"]) for r in kept]
    said.append(f"builds from seeds {', '.join(seeds[:-1])} and {seeds[-1]} (")
    said.append(
        f"base B was {pct('base task B')} and the adapter reached {pct('adapter task B')} on it; base A was "
        f"{pct('base task A')} and the adapter kept {pct('adapter task A')}"
    )
    (seed0,) = [r for r in kept if r["seed"] == 0]
    said.append(
        f"On the build from seed 0, B goes from {seed0['base task B']:.0%} to {seed0['adapter task B']:.0%}, "
        f"and A falls from {seed0['base task A']:.0%} to {seed0['adapter task A']:.0%}"
    )

    missing = [phrase for phrase in said if phrase not in readme]
    assert not missing, "README does not say what its source says:\n" + "\n".join(missing)
