"""Notebook 40 end to end on the tiny model: a reduced sweep (2 λ × 2 seeds) trains, measures, reports numbers
computed from the points' own result files, and a rerun redoes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dsr1kit import forgetting

REDUCED = ["-p", "lambdas", "[0, 0.9]", "-p", "seeds", "[0, 1]", "-p", "eval_limit", "24",
           "-p", "hari", "{max_steps: 4, sample_limit: 32, log_every: 2}"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from conftest import run_cli

    runs = tmp_path_factory.mktemp("sweep")
    proc = run_cli("run", "notebooks/40_forgetting_sweep.ipynb", "-f", "params/tiny/40_forgetting_sweep.yaml",
                   *REDUCED, "--runs-dir", str(runs), "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(runs.iterdir())


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-15)


def test_every_point_is_a_hari_run_measured_on_both_tasks(sweep):
    points = sorted((sweep / "points").glob("lambda*-seed*"))
    assert [p.name for p in points] == ["lambda0-seed0", "lambda0-seed1", "lambda0.9-seed0", "lambda0.9-seed1"]
    for p in points:
        info = json.loads((p / "run_info.json").read_text())
        result = json.loads((p / "result.json").read_text())
        assert info["steps_done"] == 4 and info["dataset"] == "data/task_b_train.jsonl"
        latest = (p / "checkpoints" / "latest").read_text().strip()
        trained = json.loads((p / "checkpoints" / latest / "params.json").read_text())
        assert (trained["lambda_kl"], trained["seed"]) == (result["lambda_kl"], result["seed"])
        assert result["n_a"] == result["n_b"] == 24 and result["kl_a"] >= 0 and result["kl_b"] >= 0


def test_report_numbers_are_computed_from_the_points_results(sweep):
    results = [forgetting.PointResult.from_dict(json.loads(p.read_text()))
               for p in sorted((sweep / "points").glob("*/result.json"))]
    summary = json.loads((sweep / "summary.json").read_text())
    assert sorted(summary["points"], key=lambda r: (r["lambda_kl"], r["seed"])) == \
        sorted([r.to_dict() for r in results], key=lambda r: (r["lambda_kl"], r["seed"]))
    expected = forgetting.by_lambda(results)
    assert len(summary["by_lambda"]) == len(expected) == 2
    for got, want in zip(summary["by_lambda"], expected):
        for key, value in want.to_dict().items():
            assert got[key] == value if not isinstance(value, float) else _same(got[key], value), key
    fit = forgetting.fit_line([r.kl_a for r in results], [r.a_drop for r in results])
    assert _same(summary["forgetting_vs_kl"]["slope"], fit.slope)
    assert summary["headline"] == forgetting.sweep_verdict(results).headline
    html = (sweep / "report.html").read_text()
    assert "Verdict:" in html and summary["headline"].split(":")[0] in html
    assert (sweep / "figures" / "frontier.png").is_file() and (sweep / "figures" / "forgetting_vs_kl.png").is_file()


def test_a_rerun_reads_every_point_back(sweep, cli):
    before = {p: p.stat().st_mtime_ns for p in (sweep / "points").rglob("*") if p.is_file()}
    proc = cli("run", "notebooks/40_forgetting_sweep.ipynb", "-f", "params/tiny/40_forgetting_sweep.yaml",
               *REDUCED, "--run-dir", str(sweep), "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = {p: p.stat().st_mtime_ns for p in (sweep / "points").rglob("*") if p.is_file()}
    assert after == before  # nothing retrained or remeasured


def test_one_point_alone_and_a_point_outside_the_sweep(sweep, tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "-m", "dsr1kit.steps.forgetting_sweep", *REDUCED, "--run-dir", str(sweep)]
    count = subprocess.run([*base, "--count"], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert count.stdout.strip() == "4"
    done = subprocess.run([*base, "--point", "3"], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and json.loads(done.stdout)["lambda_kl"] == 0.9  # measured: read back
    bad = subprocess.run([*base, "--point", "4"], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert bad.returncode == 2 and "outside the sweep's 4 points (0-3)" in bad.stderr


def test_sweep_parameters_refuse_what_the_sweep_sets_and_unknown_keys():
    from dsr1kit import params as P

    with pytest.raises(P.ParamsError, match=r"\['lambda_kl'\] are set by the sweep itself"):
        P.load("40_forgetting_sweep", overrides={"hari": {"lambda_kl": 0.5}})
    with pytest.raises(P.ParamsError, match=r"unknown notebook 20 parameter\(s\) \['learning_rate'\]"):
        P.load("40_forgetting_sweep", overrides={"hari": {"learning_rate": 0.1}})
    with pytest.raises(P.ParamsError, match="each once"):
        P.load("40_forgetting_sweep", overrides={"seeds": [0, 0]})
