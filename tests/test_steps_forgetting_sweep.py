"""Notebook 40's parameters and its one-point runner; the sweep itself runs end to end (Slurm job array, then the
notebook) in tests/test_slurm_forgetting_sweep.py, which checks the report against the points' own results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REDUCED = ["-p", "lambdas", "[0, 0.9]", "-p", "seeds", "[0, 1]"]


def test_the_runner_counts_points_and_refuses_one_outside_the_sweep(tmp_path):
    base = [sys.executable, "-m", "dsr1kit", "sweep-point", *REDUCED]
    count = subprocess.run([*base, "--count"], capture_output=True, text=True, cwd=ROOT)
    assert count.returncode == 0 and count.stdout.strip() == "4"
    bad = subprocess.run(
        [*base, "--run-dir", str(tmp_path), "--point", "4"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2 and "outside the sweep's 4 points (0-3)" in bad.stderr
    no_dir = subprocess.run([*base, "--point", "0"], capture_output=True, text=True, cwd=ROOT)
    assert no_dir.returncode == 2 and "--point needs --run-dir" in no_dir.stderr
    assert not list(tmp_path.iterdir())  # nothing trained or written


def test_points_are_lambda_major_and_each_is_a_notebook_20_run_with_its_lambda_and_seed(tmp_path):
    from dsr1kit import params as P
    from dsr1kit.steps import forgetting_sweep as sweep

    p = P.load("40_forgetting_sweep", overrides={"lambdas": [0, 0.9], "seeds": [0, 1], "hari": {"epochs": 3}})
    pts = sweep.points(p)
    assert [(pt.index, pt.lambda_kl, pt.seed) for pt in pts] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0.9, 0),
        (3, 0.9, 1),
    ]
    hp = sweep.point_params(p, pts[3], tmp_path)
    assert (hp.lambda_kl, hp.seed, hp.epochs, hp.dataset) == (0.9, 1, 3, "data/task_b_train.jsonl")
    assert hp.run_dir == str(tmp_path / "points" / "lambda0.9-seed1")


def test_sweep_parameters_refuse_what_the_sweep_sets_and_unknown_keys():
    from dsr1kit import params as P

    with pytest.raises(P.ParamsError, match=r"\['lambda_kl'\] are set by the sweep itself"):
        P.load("40_forgetting_sweep", overrides={"hari": {"lambda_kl": 0.5}})
    with pytest.raises(P.ParamsError, match=r"unknown notebook 20 parameter\(s\) \['learning_rate'\]"):
        P.load("40_forgetting_sweep", overrides={"hari": {"learning_rate": 0.1}})
    with pytest.raises(P.ParamsError, match="each once"):
        P.load("40_forgetting_sweep", overrides={"seeds": [0, 0]})


def test_baselines_follow_the_lambda_points_and_run_at_lambda_zero_on_the_steps_budget_of_b(tmp_path):
    from dsr1kit import params as P
    from dsr1kit.steps import forgetting_sweep as sweep

    p = P.load(
        "40_forgetting_sweep",
        overrides={
            "lambdas": [0, 0.9],
            "seeds": [0, 1],
            "baselines": ["small_adapter", "replay"],
            "snapshot_every": 30,
        },
    )
    pts = sweep.points(p)
    assert [(pt.index, pt.family, pt.lambda_kl, pt.seed) for pt in pts[4:]] == [
        (4, "small_adapter", 0, 0),
        (5, "small_adapter", 0, 1),
        (6, "replay", 0, 0),
        (7, "replay", 0, 1),
    ]
    assert sweep.compares_methods(p)
    hp = sweep.point_params(p, pts[4], tmp_path)
    assert (hp.lora_r, hp.lambda_kl, hp.seed, hp.snapshot_every) == (1, 0, 0, 30)
    assert hp.run_dir == str(tmp_path / "points" / "small_adapter-seed0")
    assert sweep.point_params(p, pts[2], tmp_path).lora_r == 4  # HARI keeps notebook 20's rank
    assert sweep.b_steps(p) == 120  # 320 rows / (batch 4 x accumulation 2) x 3 epochs


def test_the_smaller_adapter_takes_notebook_20_keys_the_sweep_does_not_set():
    from dsr1kit import params as P

    with pytest.raises(P.ParamsError, match=r"\['lambda_kl'\] cannot be set for the smaller adapter"):
        P.load("40_forgetting_sweep", overrides={"small_adapter": {"lambda_kl": 1.0}})
    with pytest.raises(P.ParamsError, match=r"\['lora_rank'\] cannot be set .* valid: .*lora_r"):
        P.load("40_forgetting_sweep", overrides={"small_adapter": {"lora_rank": 1}})
    with pytest.raises(P.ParamsError, match="baselines"):
        P.load("40_forgetting_sweep", overrides={"baselines": ["distillation"]})
