"""Run reports: `dsr1kit run` executes a real notebook with papermill into a run folder."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NB00 = "notebooks/00_cluster_check.ipynb"
TINY00 = "params/tiny/00_cluster_check.yaml"


def _only_run(runs: Path) -> Path:
    dirs = [d for d in runs.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory):
    """One successful cluster-check run, with a secret sentinel in the environment."""
    from conftest import run_cli

    runs = tmp_path_factory.mktemp("runs")
    sentinel = "hf_" + secrets.token_hex(16)
    proc = run_cli("run", NB00, "-f", TINY00, "--runs-dir", str(runs), env={"HF_TOKEN": sentinel})
    return proc, runs, sentinel


def test_run_succeeds_and_prints_report_path(ok_run):
    proc, runs, _ = ok_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = _only_run(runs)
    assert f"report: {run_dir / 'report.html'}" in proc.stdout


def test_run_folder_holds_report_params_env_status(ok_run):
    _, runs, _ = ok_run
    run_dir = _only_run(runs)
    assert {"report.ipynb", "report.html", "params.yaml", "env.json", "status.json", "summary.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert re.fullmatch(r"\d{8}T\d{6}Z-00_cluster_check-[0-9a-f]{6}", run_dir.name)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "ok" and status["duration_s"] > 0
    env = json.loads((run_dir / "env.json").read_text())
    assert env["packages"]["torch"].startswith("2.") and "sha" in env["git"] and env["hostname"]


def test_report_html_shows_the_checks_table_and_verdict(ok_run):
    _, runs, _ = ok_run
    html = (_only_run(runs) / "report.html").read_text()
    for text in ("gpu inventory", "/dev/shm free", "scratch dir", "Verdict: "):
        assert text in html
    assert "Verdict: FAIL" not in html


def test_papermill_ran_the_project_interpreter(ok_run):
    import sys

    _, runs, _ = ok_run
    from dsr1kit.run.tidy import MachinePaths

    run_dir = _only_run(runs)
    nb = nbformat.read(run_dir / "report.ipynb", as_version=4)
    outputs = json.dumps([c.get("outputs", []) for c in nb.cells])
    # the python check row prints the kernel's interpreter, written as the project's .venv/bin/python
    assert MachinePaths.here(run_dir)(sys.executable) in outputs and sys.executable not in outputs


def test_secret_from_environment_appears_in_no_file(ok_run):
    _, runs, sentinel = ok_run
    for path in _only_run(runs).rglob("*"):
        if path.is_file():
            assert sentinel.encode() not in path.read_bytes(), path


def test_runs_lists_the_run_with_status_and_headline(ok_run, cli):
    _, runs, _ = ok_run
    proc = cli("runs", "--runs-dir", str(runs))
    assert proc.returncode == 0
    line = [x for x in proc.stdout.splitlines() if "00_cluster_check" in x][0]
    assert " ok " in line and "fail of" in line  # headline: "N pass, N warn, 0 fail of N checks"


def test_failing_cell_gives_failed_status_and_partial_report(tmp_path, cli):
    proc = cli("run", NB00, "-f", TINY00, "-p", "shm_min_free_gib", "1e9", "--runs-dir", str(tmp_path))
    assert proc.returncode == 1
    assert "ChecksFailed" in proc.stderr and "/dev/shm free" in proc.stderr
    run_dir = _only_run(tmp_path)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed"
    assert status["failed_cell"]["ename"] == "ChecksFailed"
    assert "steps.finish(verdict)" in status["failed_cell"]["source"]
    html = (run_dir / "report.html").read_text()
    assert "gpu inventory" in html and "Verdict: FAIL" in html  # cells before the failure are kept


def test_bad_params_fail_before_anything_runs(tmp_path, cli):
    proc = cli(
        "run",
        NB00,
        "-f",
        TINY00,
        "-p",
        "expected_nodez",
        "2",
        "-p",
        "hf_token",
        "abc",
        "--runs-dir",
        str(tmp_path),
    )
    assert proc.returncode == 2
    assert "unknown key 'expected_nodez'" in proc.stderr and "looks like a secret" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_secret_printed_by_a_notebook_is_redacted(tmp_path, cli):
    """Even a cell that prints the token leaves no copy of it in the run folder."""
    nb = nbformat.read(ROOT / NB00, as_version=4)
    nb.cells.insert(3, nbformat.v4.new_code_cell("import os; print('token is', os.environ['HF_TOKEN'])"))
    leaky = tmp_path / "nb" / "00_cluster_check.ipynb"
    leaky.parent.mkdir()
    nbformat.write(nb, leaky)
    sentinel = "hf_" + secrets.token_hex(16)
    runs = tmp_path / "runs"
    proc = cli("run", str(leaky), "-f", TINY00, "--runs-dir", str(runs), "-q", env={"HF_TOKEN": sentinel})
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = _only_run(runs)
    assert "token is ***" in (run_dir / "report.html").read_text()
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert sentinel.encode() not in path.read_bytes(), path


def test_interactive_session_gets_its_own_run_dir(tmp_path):
    from dsr1kit import params
    from dsr1kit.run import report

    p = params.ClusterCheckParams()
    run_dir = report.ensure_run_dir(p.run_dir, p.notebook, runs_root=tmp_path)
    assert run_dir.parent == tmp_path.resolve() and "00_cluster_check" in run_dir.name
    assert run_dir.is_dir() and run_dir.is_absolute()


def test_other_ranks_report_under_ranks_folder(tmp_path, cli):
    """srun starts the notebook on every node: rank k>0 keeps its report in ranks/rank<k>/."""
    run_dir = tmp_path / "shared"
    proc = cli(
        "run",
        NB00,
        "-f",
        TINY00,
        "--run-dir",
        str(run_dir),
        "-q",
        env={"SLURM_NTASKS": "2", "SLURM_PROCID": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "ranks" / "rank1" / "report.html").is_file()
    assert not (run_dir / "report.html").exists()
    assert json.loads((run_dir / "ranks" / "rank1" / "status.json").read_text())["rank"] == 1


def test_sigterm_stops_the_notebooks_kernel_and_leaves_a_status(tmp_path):
    """Slurm's cancel, or a job requeueing itself, sends TERM to `dsr1kit run`: the kernel must stop with it
    (it ran on, writing results, after the job had decided to requeue), and the run still gets its status."""
    import os
    import signal
    import subprocess
    import sys
    import time

    beat, pid_file = tmp_path / "beat", tmp_path / "kernel.pid"
    nb = nbformat.read(ROOT / NB00, as_version=4)
    loop = (
        "import os, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "for i in range(1200):\n"
        f"    open({str(beat)!r}, 'w').write(str(i))\n"
        "    time.sleep(0.1)\n"
    )
    nb.cells.insert(3, nbformat.v4.new_code_cell(loop))
    slow = tmp_path / "nb" / "00_cluster_check.ipynb"
    slow.parent.mkdir()
    nbformat.write(nb, slow)
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsr1kit.cli", "run", str(slow), "-f", TINY00, "--runs-dir", str(runs), "-q"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (beat.is_file() and beat.read_text() not in ("", "0")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        kernel = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(kernel, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(kernel, signal.SIGKILL)
        raise AssertionError("the kernel outlived `dsr1kit run` after SIGTERM")
    stopped_at = beat.read_text()
    time.sleep(0.5)
    assert beat.read_text() == stopped_at  # nothing is written any more
    status = json.loads((_only_run(runs) / "status.json").read_text())
    assert status["status"] == "failed" and status["finished"]
