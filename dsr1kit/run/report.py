"""Run a notebook headlessly into a run folder: the executed notebook is the report.

``runs/<UTC time>-<notebook>-<short id>/`` holds ``report.ipynb`` (executed),
``report.html``, ``params.yaml`` (resolved), ``env.json``, ``status.json`` and
whatever the notebook writes (metrics, figures, adapters). A failing notebook
still leaves its partial report and a failed status naming the cell.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .environment import collect_environment
from .paths import PROJECT_ROOT
from .redact import redact_text, redacted_cell_log

SUMMARY = "summary.json"
STATUS = "status.json"
KERNEL_NAME = "dsr1kit"


class NotebookFailed(RuntimeError):
    """The notebook raised; the partial report and status are in ``run_dir``."""

    def __init__(self, run_dir: Path, status: dict[str, Any]):
        self.run_dir = run_dir
        self.status = status
        cell = status.get("failed_cell") or {}
        super().__init__(
            f"{status['notebook']} failed in cell {cell.get('index')} "
            f"({cell.get('ename')}: {cell.get('evalue')}); partial report: {run_dir / 'report.html'}"
        )


@dataclass
class RunResult:
    run_dir: Path
    status: dict[str, Any]


def process_rank(env: dict[str, str] | None = None) -> int:
    """This process's rank when several run the same notebook (srun one task per node, torchrun)."""
    from ..cluster.rendezvous import process_ranks

    return process_ranks(env)[0]


def new_run_id(notebook: str) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{Path(notebook).stem}-{secrets.token_hex(3)}"


def ensure_run_dir(run_dir: str | Path, notebook: str, runs_root: str | Path | None = None) -> Path:
    """The run folder for a notebook session: ``run_dir`` when given, else a fresh one under ``runs_root``
    (an interactive session), returned resolved."""
    path = Path(run_dir) if run_dir else Path(runs_root or PROJECT_ROOT / "runs") / new_run_id(notebook)
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve() if not run_dir else path


def record_summary(run_dir: str | Path, headline: str = "", **metrics: Any) -> dict[str, Any]:
    """Merge metrics into summary.json; ``headline`` is what `dsr1kit runs` shows."""
    path = Path(run_dir) / SUMMARY
    data = json.loads(path.read_text()) if path.is_file() else {}
    if headline:
        data["headline"] = headline
    data.update(metrics)
    _write_json(path, data)
    return data


def _write_json(path: Path, data: Any) -> None:
    """Whole or absent. The temp name is this process's own: ranks of one run may write the file at once, and a
    shared temp name made one rank's rename fail (FileNotFoundError) after the other had moved it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def ensure_kernelspec() -> str:
    """A kernelspec that runs *this* interpreter, so the report uses the project's environment."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (dsr1kit)",
        "language": "python",
        "metadata": {"debugger": True},
    }
    kernel_dir = Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME
    current = kernel_dir / "kernel.json"
    try:
        if not current.is_file() or json.loads(current.read_text()) != spec:
            kernel_dir.mkdir(parents=True, exist_ok=True)
            current.write_text(json.dumps(spec, indent=1))
    except OSError:  # read-only prefix: fall back to a user-writable path
        kernel_dir = Path.home() / ".local" / "share" / "jupyter" / "kernels" / KERNEL_NAME
        kernel_dir.mkdir(parents=True, exist_ok=True)
        (kernel_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    KernelSpecManager().get_kernel_spec(KERNEL_NAME)  # raises if Jupyter cannot see it
    return KERNEL_NAME


def redact_secrets(run_dir: Path) -> list[str]:
    """Mask any environment secret found in the run folder's files (any size); return the touched files."""
    from .redact import redact_tree

    return redact_tree(run_dir)


def render_html(ipynb: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(ipynb))
    out = ipynb.with_suffix(".html")
    out.write_text(body)
    return out


def _failed_cell(ipynb: Path) -> dict[str, Any] | None:
    import nbformat

    nb = nbformat.read(ipynb, as_version=4)
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and out.get("ename") != "PapermillExecutionError":
                return {
                    "index": i,
                    "execution_count": cell.get("execution_count"),
                    "ename": out.get("ename"),
                    "evalue": out.get("evalue"),
                    "source": cell.source[:400],
                }
    return None


def find_notebook(notebook: str | Path) -> Path:
    """The notebook file, or FileNotFoundError naming the kit's notebooks."""
    notebook = Path(notebook)
    if not notebook.is_file():
        known = sorted(p.name for p in (PROJECT_ROOT / "notebooks").glob("*.ipynb"))
        raise FileNotFoundError(
            f"notebook not found: {notebook}; the kit's notebooks: "
            + ", ".join(f"notebooks/{k}" for k in known)
        )
    return notebook


@contextlib.contextmanager
def kernel_stops_on_term():
    """SIGTERM to this process (Slurm's cancel, or a job requeueing itself before its time limit) stops the
    notebook's kernel too, then leaves as Ctrl-C would (the status and partial report are still written).

    papermill runs the kernel as a child process; without this, the kernel outlives us and goes on executing
    its cell: an evaluation kept asking and writing answers after the job had decided to requeue, so the
    requeued job found them all answered."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def on_term(_signum, _frame):
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.terminate()
            except psutil.Error:
                pass
        raise KeyboardInterrupt("SIGTERM: the notebook's kernel was stopped")

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_notebook(
    notebook: str | Path,
    parameters: dict[str, Any],
    param_files: list[str | Path] = (),
    overrides: dict[str, Any] | None = None,
    runs_root: str | Path = "runs",
    run_dir: str | Path | None = None,
    log_output: bool = True,
) -> RunResult:
    """Execute the notebook with papermill on ``parameters`` (its values, validated by the caller), render
    HTML, write status. ``run_dir`` (or ``parameters["run_dir"]``) is the exact run folder; else a new one
    under ``runs_root``.

    ``param_files`` and ``overrides`` are only recorded in status.json. Raises NotebookFailed (after writing
    the partial report) when a cell raises.
    """
    import papermill as pm

    from .tidy import MachinePaths, tidy_report

    notebook = find_notebook(notebook)
    resolved = dict(parameters)
    if run_dir:
        resolved["run_dir"] = str(Path(run_dir).resolve())
    shared_dir = ensure_run_dir(resolved.get("run_dir") or "", notebook.stem, runs_root)
    resolved["run_dir"] = str(shared_dir)
    rank = process_rank()
    # Every rank works in the shared run folder; rank 0's report is the run report, the others
    # keep theirs under ranks/rank<k>/ (a failing rank's traceback is there).
    out_dir = shared_dir if rank == 0 else shared_dir / "ranks" / f"rank{rank}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "params.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    _write_json(out_dir / "env.json", collect_environment())
    status: dict[str, Any] = {
        "run_id": shared_dir.name,
        "notebook": notebook.stem,
        "status": "running",
        "rank": rank,
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "param_files": [str(f) for f in param_files],
        "overrides": sorted((overrides or {}).keys()),
    }
    _write_json(out_dir / STATUS, status)
    ipynb = out_dir / "report.ipynb"
    t0 = time.monotonic()
    error: BaseException | None = None
    try:
        with redacted_cell_log(), kernel_stops_on_term():
            pm.execute_notebook(
                str(notebook),
                str(ipynb),
                parameters=resolved,
                kernel_name=ensure_kernelspec(),
                cwd=str(notebook.parent.resolve()),
                log_output=log_output,
                progress_bar=False,
                report_mode=False,
            )
    except pm.PapermillExecutionError as exc:
        error = exc
    except BaseException as exc:  # kernel death, KeyboardInterrupt: still leave a status
        error = exc
        if not isinstance(exc, Exception):
            raise
    finally:
        status["duration_s"] = round(time.monotonic() - t0, 2)
        status["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        status["status"] = "failed" if error is not None else "ok"
        if error is not None:
            cell = _failed_cell(ipynb) if ipynb.is_file() else None
            status["failed_cell"] = cell or {
                "index": None,
                "ename": type(error).__name__,
                "evalue": str(error)[:400],
            }
        # the report, summary.json and status.json as a teammate reads them (dsr1kit.run.tidy)
        paths = MachinePaths.here(shared_dir)  # in the files; the terminal (status returned) keeps real paths
        summary = shared_dir / SUMMARY
        if summary.is_file():
            status["summary"] = json.loads(summary.read_text())
            if rank == 0:
                _write_json(summary, paths.walk(status["summary"]))
        if ipynb.is_file():
            tidy_report(ipynb, shared_dir, status, paths)
            render_html(ipynb)
        status = json.loads(redact_text(json.dumps(status, default=str)))  # also the copy raised below
        _write_json(out_dir / STATUS, paths.walk(status))
        redact_secrets(out_dir)
    if error is not None:
        raise NotebookFailed(out_dir, status) from None  # the cell's traceback is in the report, masked
    return RunResult(out_dir, status)


def list_runs(runs_root: str | Path = "runs") -> list[dict[str, Any]]:
    rows = []
    for status_file in sorted(Path(runs_root).glob(f"*/{STATUS}")):
        try:
            s = json.loads(status_file.read_text())
            if not isinstance(s, dict):
                raise ValueError(f"holds a {type(s).__name__}, not an object")
        except (OSError, ValueError) as err:  # listed, not dropped: the run folder is still there
            rows.append(
                {
                    "id": status_file.parent.name,
                    "notebook": "?",
                    "status": "unreadable",
                    "duration_s": None,
                    "headline": f"{STATUS}: {str(err).splitlines()[0][:80]}",
                }
            )
            continue
        summary = s.get("summary") if isinstance(s.get("summary"), dict) else {}
        rows.append(
            {
                "id": s.get("run_id", status_file.parent.name),
                "notebook": s.get("notebook", "?"),
                "status": s.get("status", "?"),
                "duration_s": s.get("duration_s"),
                "headline": summary.get("headline", ""),
            }
        )
    return rows


def format_runs(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs yet"
    cols = ["id", "notebook", "status", "duration_s", "headline"]
    cells = [[str(r.get(c) if r.get(c) is not None else "") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])
