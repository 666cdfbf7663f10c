"""Notebook 40 comparing methods, reduced: HARI (λ = 0.9) and replay of the base's answers, 2 seeds, 2 points
per run (a snapshot halfway and the end), run headless as `make compare` runs it. The report's matched gains,
costs and verdict are recomputed here from the points' own result files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsr1kit.measure import frontier
from dsr1kit.measure.sweep import PointResult

ROOT = Path(__file__).resolve().parent.parent
REDUCED = {
    "lambdas": "[0.9]",
    "seeds": "[0, 1]",
    "baselines": "[replay]",
    "snapshot_steps": "[]",
    "snapshot_every": "60",  # 120 steps: a snapshot at 60, the end at 120
    "eval_limit": "60",
    "replay_limit": "60",
    "replay_ratio": "0.125",  # 40 replay rows beside B's 320
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("comparison") / "run"
    args = [sys.executable, "-m", "dsr1kit", "run", "notebooks/40_forgetting_sweep.ipynb"]
    args += ["-f", "params/tiny/methods/40_forgetting_sweep.yaml", "--run-dir", str(run_dir), "-q"]
    for key, value in REDUCED.items():
        args += ["-p", key, value]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return run_dir


def _measured(run: Path) -> list[PointResult]:
    files = sorted((run / "points").glob("*/result.json")) + sorted(
        (run / "points").glob("*/snapshots/*/result.json")
    )
    return [PointResult.from_dict(json.loads(f.read_text())) for f in files]


def test_each_method_has_two_seeds_of_two_points_on_the_same_steps_budget(run):
    results = _measured(run)
    by_method: dict[str, list[PointResult]] = {}
    for r in results:
        by_method.setdefault(frontier.method_of(r), []).append(r)
    assert sorted(by_method) == ["hari", "replay"]
    for method, points in by_method.items():
        assert sorted((r.seed, r.step) for r in points) == [(0, 60), (0, 120), (1, 60), (1, 120)], method
        assert all(r.total_steps == 120 and r.tokens > 0 and r.train_s > 0 for r in points), method
        assert all(r.n_a == 60 and r.n_b == 60 for r in points)
    # replay trained on B plus the base's answers, within B's budget of steps
    info = json.loads((run / "points" / "replay-seed0" / "run_info.json").read_text())
    assert info["samples"] == 360 and info["total_steps"] == 120
    assert (run / "replay" / "answers.jsonl").is_file()


def test_the_report_numbers_are_the_points_own(run):
    results = _measured(run)
    summary = json.loads((run / "summary.json").read_text())
    fractions = [0.5, 0.75, 0.9]
    levels = frontier.matched_gains(results, fractions)
    reported = summary["comparison"]["matched_gains"]
    assert [lv["gain"] for lv in reported] == pytest.approx([lv.gain for lv in levels])
    for got, want in zip(reported, levels):
        assert got["outcome"] == want.outcome
        for g, w in zip(got["methods"], want.methods):
            assert g["method"] == w.method and g["values"] == pytest.approx(w.values)
    verdict = frontier.comparison_verdict(levels)
    assert summary["headline"] == verdict.headline
    assert summary["comparison"]["verdict"]["headline"] == verdict.headline
    costs = {c["method"]: c for c in summary["comparison"]["costs"]}
    ends = [r for r in results if r.final and frontier.method_of(r) == "hari"]
    assert costs["hari"]["tokens"] == pytest.approx(sum(r.tokens for r in ends) / len(ends))
    # the λ sweep's part reads HARI's end points only
    assert [p["lambda_kl"] for p in summary["points"]] == [0.9, 0.9]
    assert (run / "figures" / "methods_frontier.png").is_file()
    html = (run / "report.html").read_text()
    assert "Against the cheaper methods" in html and "seeds reached" in html and "tokens per run" in html
