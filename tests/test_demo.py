"""`dsr1kit demo` (what `make demo` runs) end to end on a fresh cache that holds only the embedded model, as a
fresh machine has it once the model is built (the session's ``tiny_dir`` builds it with the same
``resolve_model`` the demo calls, so building it a second time here would test nothing new): notebooks 00, 20,
10 and 30 run on it. Each of the four reports is checked as a
teammate would read it: ok, no stderr box in a cell that ran through, a Warnings section, the verdict
first, the memory plan as a table, and no path of this machine (home, temp dir, virtual environment) in
the report, summary.json or status.json. The demo's story holds: HARI on task B raises B and lowers A."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT

pytest.importorskip("vllm")
DEMO_TIMEOUT_S = 1800  # the demo takes ~3 min alone; under a parallel suite, longer
pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT_S)]

NOTEBOOKS = ("00_cluster_check", "20_hari_training", "10_vllm_inference", "30_adapter_inspection")


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo")
    shutil.copytree(tiny_dir, root / "cache" / tiny_dir.name)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsr1kit", "demo", "--runs-dir", str(root / "runs"), "-q"],
        cwd=ROOT,
        env={**os.environ, "DSR1KIT_CACHE": str(root / "cache")},  # nothing cached but the model
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its kernels and servers go with it if the test is stopped
    )
    try:
        out, err = proc.communicate(timeout=DEMO_TIMEOUT_S - 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    listed = re.findall(r"^\s+ok\s+(\S+)\s+(\S+/report\.html)$", out, re.M)
    assert [name for name, _ in listed] == list(NOTEBOOKS), out[-2000:]
    return {name: Path(report).parent for name, report in listed}


def _machine_prefixes() -> list[str]:
    return [str(Path.home()) + "/", tempfile.gettempdir() + "/", sys.prefix, sysconfig.get_paths()["purelib"]]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_report_reads_clean(demo, name):
    run_dir = demo[name]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "ok", status
    nb = json.loads((run_dir / "report.ipynb").read_text())
    stderr = [
        (i, "".join(o["text"])[:200])
        for i, c in enumerate(nb["cells"])
        for o in c.get("outputs", [])
        if o.get("name") == "stderr"
    ]
    assert stderr == [], stderr  # every cell ran through: no red box
    tags = [
        (c.get("metadata", {}).get("tags") or [""])[0] for c in nb["cells"] if c["cell_type"] == "markdown"
    ]
    assert "dsr1kit-banner" in tags and tags[-1] == "dsr1kit-warnings"
    html = (run_dir / "report.html").read_text()
    verdict = re.search(r"Verdict: (OK|WARN)", html)
    assert verdict and verdict.start() < html.index("# Parameters")  # the verdict before anything else
    if name != "00_cluster_check":  # 00 plans nothing without plan_files
        assert re.search(r"memory plan, [^<]*</b>.*?<table", html, re.S), "the memory plan is not a table"
    for path in (
        run_dir / "report.ipynb",
        run_dir / "report.html",
        run_dir / "summary.json",
        run_dir / "status.json",
    ):
        text = path.read_text()
        found = [prefix for prefix in _machine_prefixes() if prefix in text]
        assert not found, f"{path.name} names this machine: {found}"


def test_the_embedded_model_the_demo_ran_on_learned_its_tasks(demo):
    from dsr1kit.embedded.tiny import LEARNED

    (record,) = (demo["20_hari_training"].parent.parent / "cache").glob("tiny-dsv3-*/TINY_MODEL.json")
    built = json.loads(record.read_text())
    print(built["builds"])
    assert set(built["position_accuracy"]) == {"A", "S", "E"}
    assert all(v >= LEARNED for v in built["position_accuracy"].values()), built


def test_hari_on_task_b_raises_b_and_lowers_a(demo):
    summary = json.loads((demo["10_vllm_inference"] / "summary.json").read_text())
    acc = {(r["model"], r["category"]): r["accuracy"] for r in summary["accuracy"]}
    print({f"{m} {c}": a for (m, c), a in acc.items()})
    assert acc[("adapter", "task B")] > acc[("base", "task B")] + 0.15
    assert acc[("adapter", "task A")] < acc[("base", "task A")] - 0.15
