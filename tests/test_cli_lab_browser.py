"""The notebooks as people use them: JupyterLab in a real headless browser.

Each test starts JupyterLab with `dsr1kit lab` (the project root, the dsr1kit kernel, the URL with
its token read from the command's output), opens the notebook with a double-click in the file
browser, clicks Run → Run All Cells in Debian's chromium (driven by Playwright, no downloaded
browser), waits for the kernel to be idle with every cell executed, and asserts on what the page
shows: the checks table (00), the loss plot (20), the adapter table (30), the accuracy table (10),
the sweep's points and frontier (40), and no error output anywhere. A screenshot per notebook goes
to test-artifacts/browser/.

Parameters: 00 runs exactly as shipped (its run folder lands in the project's runs/, as for a
person, and is removed afterwards). For 20, 30 and 10 the test pastes a few lines at the end of
the parameters cell, as a person would, to put the run folder in the test's own runs folder and
to shrink the run (20: 4 steps; 30: 4 probes, 1 answer; 10: 4 questions, base model only, one
server start; 40: two points of 4 steps, 16 rows per task; 10's merged-adapter path is covered headless
by test_infer_notebook.py), so the five notebooks together take about three minutes. Nothing is
saved: autosave is off in a throwaway settings folder, and every test checks that notebooks/ is byte for byte unchanged.

Nothing outlives a test: the server is shut down through /api/shutdown, then every process it
started (kernel, ranks, vLLM server) is killed with its process group if still there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
# What this machine's closed network needs (env/machines/python.md); Playwright adds a fresh
# --user-data-dir itself.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KERNEL_IDLE = "Python 3 (dsr1kit) | Idle"  # the status bar, once the project's kernel is idle
ERROR_TEXT = re.compile(r"Traceback|\b\w*Error:|\bException:")

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------
# fixtures: JupyterLab (through `dsr1kit lab`), the browser, the shared runs folder


@dataclass
class Lab:
    token: str
    proc: subprocess.Popen
    log: Path
    remove_after: list[Path] = field(default_factory=list)  # run folders to delete once stopped
    _url: str = ""

    @property
    def url(self) -> str:
        """The URL `dsr1kit lab` printed (waited for on first use: the browser starts meanwhile)."""
        if not self._url:
            self._url = _wait_for_url(self.proc, self.log, timeout=90)
            assert f"token={self.token}" in self._url
            assert self._url.split("?")[0].endswith("/lab/tree/notebooks")
        return self._url

    @property
    def base(self) -> str:
        return self.url.split("/lab/")[0]

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(
            f"{self.base}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium; `make sysdeps` installs it)")
    return CHROMIUM


@pytest.fixture
def lab(tmp_path: Path, chromium: Path):
    """`dsr1kit lab` on a free port; settings, workspaces, checkpoints and runtime files in tmp."""
    settings = tmp_path / "lab-settings"
    for plugin, values in {
        "docmanager-extension/plugin": {"autosave": False},
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        f = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    token = secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_TOKEN": token,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
    }
    log = tmp_path / "lab.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsr1kit.cli",
                "lab",
                "--port",
                "0",
                "--",
                f"--LabApp.user_settings_dir={settings}",
                f"--LabApp.workspaces_dir={tmp_path / 'lab-workspaces'}",
                f"--FileCheckpoints.checkpoint_dir={tmp_path / 'checkpoints'}",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Lab(token=token, proc=proc, log=log)
    try:
        yield server
    finally:
        try:
            _stop(proc, token, log, tmp_path / "jupyter-runtime")
        finally:
            for run in server.remove_after:
                shutil.rmtree(run, ignore_errors=True)


def _wait_for_url(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"^\s+(http://\S+/lab/tree/notebooks\?token=\S+)$", log.read_text(), re.M)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            pytest.fail(f"`dsr1kit lab` exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"`dsr1kit lab` printed no URL within {timeout} s:\n{log.read_text()[-3000:]}")


def _cmdlines(pid: int) -> list[str]:
    """The command lines of a process's descendants; one that exited meanwhile (a zombie under load) has
    none left to show and is skipped (psutil.ZombieProcess is a NoSuchProcess)."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return out


def _stop(proc: subprocess.Popen, token: str, log: Path, runtime_dir: Path) -> None:
    """Shut JupyterLab down (kernels first), then kill whatever it started that is still there."""
    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    for p in psutil.process_iter(["cmdline"]):  # kernels, found by their connection file, even if orphaned
        if any(str(runtime_dir) in arg for arg in p.info["cmdline"] or []) and p not in started:
            try:
                started += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    url = re.search(r"(http://[^/\s]+)/lab/tree/notebooks\?token=", log.read_text())
    if url and proc.poll() is None:
        try:
            req = urllib.request.Request(
                f"{url.group(1)}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
            )
            urllib.request.urlopen(req, timeout=10).close()
            proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
    own_group = os.getpgrp()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # `dsr1kit lab` and the server: the group it was started in
    except ProcessLookupError:
        pass
    for p in [*started, proc]:
        pid = p.pid
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        try:
            if pgid != own_group:
                os.killpg(pgid, signal.SIGKILL)  # the kernel and vLLM run in groups of their own
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(10)
    _, alive = psutil.wait_procs([p for p in started if p.is_running()], timeout=10)
    assert not alive, f"processes outlived the test: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture
def page(chromium: Path):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            yield context.new_page()
            context.close()
        finally:
            browser.close()


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """Run folders of 20, 30 and 10: one folder, so 30 finds 20's adapter beside its own run."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(autouse=True)
def notebooks_untouched():
    """The browser edits the open notebook only: nothing is saved into notebooks/."""
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in NOTEBOOKS.iterdir() if p.is_file()}
    dirs = sorted(p.name for p in NOTEBOOKS.iterdir() if p.is_dir())
    yield
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in NOTEBOOKS.iterdir() if p.is_file()}
    assert after == before, "a notebook file changed on disk"
    assert sorted(p.name for p in NOTEBOOKS.iterdir() if p.is_dir()) == dirs


# ---------------------------------------------------------------------------------------------
# what a person does in JupyterLab, and what they see


def open_and_run_all(page: Page, lab: Lab, name: str, typed_params: str = "", timeout_s: float = 400) -> dict:
    """Open NAME from the file browser, optionally add lines to the parameters cell, Run All."""
    page.goto(lab.url)
    item = page.locator(".jp-DirListing-item").filter(has=page.get_by_text(f"{name}.ipynb", exact=True))
    item.wait_for(timeout=60_000)
    item.dblclick()
    page.locator("#jp-main-statusbar").get_by_text(KERNEL_IDLE).wait_for(timeout=120_000)
    assert (
        page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel").text_content()
        == f"{name}.ipynb"
    )
    sessions = lab.api("/api/sessions")
    assert [(s["path"], s["kernel"]["name"]) for s in sessions] == [(f"notebooks/{name}.ipynb", "dsr1kit")]

    cells = page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")
    if typed_params:
        editor = cells.nth(1).locator(".cm-content")
        assert "# Parameters" in editor.text_content()
        editor.click()
        page.keyboard.press("Control+End")
        page.keyboard.insert_text("\n" + typed_params.strip())  # as pasted; typing key by key costs ~2 s
        page.keyboard.press("Escape")
        lines = cells.nth(1).locator(".cm-line").all_text_contents()
        for line in typed_params.strip().splitlines():
            assert line in lines, f"typed line {line!r} not in the parameters cell"

    before = cells.locator(".jp-InputArea-prompt").all_text_contents()
    page.locator("#jp-MainMenu .lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu:visible .lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    # Run All queues every code cell at once ("[*]:"); it is over when none is queued or running and
    # the kernel is idle. After an error the cells below stay "[ ]:" (JupyterLab shows an error
    # output as stderr text, so the traceback is what tells it from a warning).
    started = time.monotonic()
    state, began = {}, False
    while time.monotonic() - started < timeout_s:
        state = page.evaluate("""() => {
            const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
            const prompts = [...nb.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
                .map(e => e.textContent.trim());
            return {prompts, status: document.querySelector('#jp-main-statusbar').textContent};
        }""")
        running = "[*]:" in state["prompts"]
        began = began or running or state["prompts"] != before
        if began and not running and KERNEL_IDLE in state["status"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"{name}: run-all not finished after {timeout_s} s; prompts {state.get('prompts')}")
    screenshot(page, name)  # first: the tall viewport lays every output out
    outputs = read_outputs(page)
    errors = [
        o
        for o in outputs
        if o["mime"] in ("application/vnd.jupyter.error", "application/vnd.jupyter.stderr")
        and ERROR_TEXT.search(o["text"])
    ]
    assert not errors, f"{name}: error output in the notebook:\n" + "\n---\n".join(
        o["text"][-2000:] for o in errors
    )
    assert all(re.fullmatch(r"\[\d+\]:", p) for p in state["prompts"]), state["prompts"]
    return {"outputs": outputs, "seconds": round(time.monotonic() - started, 1)}


def read_outputs(page: Page) -> list[dict]:
    """Every output the page shows: mime type, text, its tables (header + rows) and images."""
    return page.evaluate("""() => {
        const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
        const cells = [...nb.querySelectorAll('.jp-Cell')];
        const out = [];
        cells.forEach((cell, i) => cell.querySelectorAll('.jp-OutputArea-output').forEach(o => out.push({
            cell: i, mime: o.getAttribute('data-mime-type'), text: o.textContent,
            source: (cell.querySelector('.jp-InputArea .cm-content') || {}).textContent || '',
            tables: [...o.querySelectorAll('table')].map(t => ({
                header: [...t.querySelectorAll('thead th')].map(th => th.textContent.trim()),
                rows: [...t.querySelectorAll('tbody tr')]
                    .map(tr => [...tr.children].map(td => td.textContent.trim()))})),
            images: [...o.querySelectorAll('img')].map(img => ({
                src: img.src.slice(0, 22), width: img.naturalWidth, height: img.naturalHeight,
                shown: img.getBoundingClientRect().width})),
        })));
        return out;
    }""")


def screenshot(page: Page, name: str) -> Path:
    """The whole notebook after run-all: a viewport as tall as the notebook, from the top."""
    for _ in range(3):  # cells off screen have estimated heights until laid out: settle
        extra = page.evaluate("""() => {
            const s = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer');
            const cells = s.querySelectorAll('.jp-Cell');
            const bottom = cells[cells.length - 1].getBoundingClientRect().bottom;
            return Math.ceil(bottom - s.getBoundingClientRect().top + s.scrollTop - s.clientHeight);
        }""")
        if extra <= 0:
            break
        height = min(page.viewport_size["height"] + extra + 20, 12000)
        page.set_viewport_size({"width": 1400, "height": height})
        page.wait_for_timeout(300)
    page.evaluate("""() => document.querySelector(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer').scrollTo(0, 0)""")
    page.wait_for_timeout(500)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=path)
    return path


def tables_with(outputs: list[dict], *columns: str) -> list[dict]:
    return [t for o in outputs for t in o["tables"] if set(columns) <= set(t["header"])]


def text_of(outputs: list[dict]) -> str:
    return "\n".join(o["text"] for o in outputs)


def column(table: dict, name: str) -> list[str]:
    i = table["header"].index(name)
    return [row[i] for row in table["rows"]]


# ---------------------------------------------------------------------------------------------
# the five notebooks


def test_cluster_check_shows_the_checks_table(lab, page):
    res = open_and_run_all(page, lab, "00_cluster_check", timeout_s=300)
    out = res["outputs"]
    run_dir = Path(re.search(r"run folder: (\S+)", text_of(out)).group(1))
    if run_dir.parent == ROOT / "runs" and "00_cluster_check" in run_dir.name:
        lab.remove_after.append(run_dir)
    assert run_dir.parent == ROOT / "runs"  # an empty run_dir means the project's runs/, not notebooks/runs
    (checks,) = tables_with(out, "name", "status", "measured", "expected", "fix")
    assert len(checks["rows"]) >= 10
    assert set(column(checks, "status")) <= {"pass", "warn"}
    assert {"ranks reported", "all-reduce"} <= set(column(checks, "name"))
    assert "Verdict: OK" in text_of(out)
    assert (run_dir / "summary.json").is_file()
    plots = [img for o in out if "bandwidth_figure" in o["source"] for img in o["images"]]
    assert plots and all(img["src"].startswith("data:image/png") and img["shown"] > 200 for img in plots)


def test_hari_training_shows_the_loss_plot(lab, page, runs_root):
    typed = f"""
# a short run in a folder of my own
run_dir = '{runs_root}/browser-20_hari_training'
sample_limit = 32
max_steps = 4
log_every = 1
"""
    out = open_and_run_all(page, lab, "20_hari_training", typed)["outputs"]
    plots = [img for o in out if "training_curves" in o["source"] for img in o["images"]]
    assert plots, "no image in the training-curves cell"
    assert all(
        img["src"].startswith("data:image/png") and img["width"] > 300 and img["shown"] > 300 for img in plots
    )
    assert tables_with(out, "source", "split", "kept")  # the data table
    assert "Verdict: OK" in text_of(out) and "steps done: 4 of 4" in text_of(out)
    assert (runs_root / "browser-20_hari_training" / "adapter" / "adapter_config.json").is_file()


@pytest.fixture
def hari_adapter(runs_root: Path, cli) -> Path:
    """20's adapter from the browser test; when that did not run (-k), the same run headless."""
    found = sorted(runs_root.glob("*20_hari_training*/adapter/adapter_config.json"))
    if not found:
        res = cli(
            "run",
            "notebooks/20_hari_training.ipynb",
            "-f",
            "params/tiny/20_hari_training.yaml",
            "-q",
            "-p",
            "sample_limit",
            "32",
            "-p",
            "max_steps",
            "4",
            "--run-dir",
            str(runs_root / "headless-20_hari_training"),
        )
        assert res.returncode == 0, res.stderr[-3000:]
        found = sorted(runs_root.glob("*20_hari_training*/adapter/adapter_config.json"))
    return found[-1].parent


def test_adapter_inspection_shows_the_adapter_table(lab, page, runs_root, hari_adapter):
    typed = f"""
# a short inspection in a folder of my own (the newest adapter beside it)
run_dir = '{runs_root}/browser-30_adapter_inspection'
n_probe = 4
n_generate = 1
max_new_tokens = 8
"""
    out = open_and_run_all(page, lab, "30_adapter_inspection", typed)["outputs"]
    assert f"adapter: {hari_adapter} " in text_of(out)
    (table,) = tables_with(out, "module", "rank", "norm_delta", "ratio", "effective_rank")
    modules = column(table, "module")
    assert any(m.endswith("q_a_proj") for m in modules) and any(m.endswith("q_b_proj") for m in modules)
    assert all(float(v) >= 0 for v in column(table, "norm_delta"))
    assert "lora_B is non-zero in every module" in text_of(out)
    assert tables_with(out, "probe set", "top-1 agreement")  # how far the model moved
    assert any(img["width"] > 300 for o in out for img in o["images"])
    assert re.search(r"Verdict: (OK|WARN)", text_of(out))


def test_vllm_inference_shows_the_accuracy_table(lab, page, runs_root):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make vllm)")
    typed = f"""
# the base model on 4 questions, in a folder of my own
run_dir = '{runs_root}/browser-10_vllm_inference'
lora_adapter = ''
eval_limit = 4
max_new_tokens = 8
"""
    out = open_and_run_all(page, lab, "10_vllm_inference", typed, timeout_s=500)["outputs"]
    (acc,) = tables_with(out, "model", "category", "accuracy", "ci95_low", "ci95_high", "scored_on")
    overall = dict(zip(acc["header"], acc["rows"][0]))
    assert overall["model"] == "base" and overall["category"] == "all"
    assert re.fullmatch(r"\d+\.\d%", overall["accuracy"]) and overall["scored_on"].startswith("4")
    assert "base" in text_of(out) and "scored on 4 of 4" in text_of(out)
    assert "server stopped" in text_of(out)
    plots = [img for o in out if "latency_figure" in o["source"] for img in o["images"]]
    assert plots and all(img["src"].startswith("data:image/png") and img["shown"] > 200 for img in plots)


def test_forgetting_sweep_shows_the_points_and_the_frontier(lab, page, runs_root):
    typed = f"""
# two points, short, in a folder of my own
run_dir = '{runs_root}/browser-40_forgetting_sweep'
lambdas = [0.0, 0.9]
seeds = [0]
eval_limit = 16
hari = {{'max_steps': 4, 'sample_limit': 32, 'lora_last_k_layers': 3, 'lr': 0.02}}
"""
    out = open_and_run_all(page, lab, "40_forgetting_sweep", typed, timeout_s=400)["outputs"]
    (points,) = tables_with(out, "lambda_kl", "seed", "acc_b", "b_gain", "acc_a", "a_drop")
    assert [float(v) for v in column(points, "lambda_kl")] == [0.0, 0.9]
    assert all(0 <= float(v) <= 1 for v in column(points, "acc_a") + column(points, "acc_b"))
    assert tables_with(out, "lambda_kl", "runs", "B gain", "A drop")  # the per-λ means
    plots = [img for o in out if "frontier_figure" in o["source"] for img in o["images"]]
    assert len(plots) == 2 and all(
        img["src"].startswith("data:image/png") and img["shown"] > 200 for img in plots
    )
    assert re.search(r"Verdict: (OK|WARN)", text_of(out))
    assert (runs_root / "browser-40_forgetting_sweep" / "summary.json").is_file()


def test_lab_without_a_token_prints_a_random_one_that_guards_the_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"))
    log = tmp_path / "lab.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsr1kit.cli", "lab"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    token = ""
    try:
        url = _wait_for_url(proc, log, timeout=90)
        token = url.split("token=")[1]
        assert re.fullmatch(r"[0-9a-f]{48}", token)
        base = url.split("/lab/")[0]
        assert base.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(
            urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
        ) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(f"{base}/api/status")
        assert denied.value.code == 403
        cmdlines = _cmdlines(proc.pid)
        assert cmdlines and not any(token in c for c in cmdlines)  # not on a command line (ps shows those)
    finally:
        _stop(proc, token, log, tmp_path / "rt")
