"""`dsr1kit run | demo | plan | runs | tiny | lab`: the kit's command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .params import ParamsError, parse_override
from .run.paths import PROJECT_ROOT

DEMO_ORDER = ("00_cluster_check", "20_hari_training", "10_vllm_inference", "30_adapter_inspection")


def _cmd_run(args: argparse.Namespace) -> int:
    from . import params
    from .run.report import NotebookFailed, find_notebook, run_notebook

    overrides = {k: parse_override(v) for k, v in args.param}
    try:
        notebook = find_notebook(args.notebook)
        p = params.load(notebook, args.params_file, overrides)
        result = run_notebook(notebook, p, args.params_file, overrides, runs_root=args.runs_dir,
                              run_dir=args.run_dir, log_output=not args.quiet)
    except (ParamsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NotebookFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"report: {result.run_dir / 'report.html'} ({result.status['status']}, "
          f"{result.status['duration_s']} s)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Every notebook on the embedded tiny model, in pipeline order: the tiny set, plus params/demo's
    layer where a notebook has one (HARI on task B, then base vs adapter scored on B and on A)."""
    from . import params
    from .run.report import NotebookFailed, run_notebook

    failed = 0
    done = []
    for name in DEMO_ORDER:
        nb = Path(args.notebooks_dir) / f"{name}.ipynb"
        prm = [PROJECT_ROOT / "params" / "tiny" / f"{name}.yaml"]
        overlay = PROJECT_ROOT / "params" / "demo" / f"{name}.yaml"  # the demo's task: train on B, score B and A
        if overlay.is_file():
            prm.append(overlay)
        if not nb.is_file():  # a broken checkout: say so instead of running a shorter demo
            failed += 1
            print(f"error: {nb} is missing (restore it: git checkout -- {nb})", file=sys.stderr)
            done.append((name, "MISSING", nb))
            continue
        print(f"== {name}", flush=True)
        try:
            result = run_notebook(nb, params.load(nb, prm), prm, runs_root=args.runs_dir,
                                  log_output=not args.quiet)
            done.append((name, "ok", result.run_dir / "report.html"))
        except NotebookFailed as err:
            failed += 1
            done.append((name, "FAILED", err.run_dir / "report.html"))
    print("\ndemo reports:")
    for name, status, where in done:
        print(f"  {status:7s} {name:24s} {where}")
    return 1 if failed else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory plan of a params file's step for this node (or the machine given); run nothing."""
    from . import params
    from .plan import Machine
    from .steps.plans import plans_for

    files = [args.params_file, *args.extra_file]
    notebook = args.notebook or Path(args.params_file).stem
    try:
        p = params.load(notebook, files, {k: parse_override(v) for k, v in args.param})
    except (ParamsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    machine = Machine.detect().with_overrides(args.gpus, args.gpu_gib, args.host_gib)
    plans = plans_for(notebook, p, machine)
    if not plans:
        print(f"{notebook} loads no model: nothing to plan")
    for plan in plans:
        print(plan.text() if plan.fits else plan.refusal(), end="\n\n")
    return 0 if all(pl.fits for pl in plans) else 3


def _cmd_runs(args: argparse.Namespace) -> int:
    from .run.report import format_runs, list_runs

    print(format_runs(list_runs(args.runs_dir)))
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from .embedded.tiny import build

    print(f"tiny model and tokenizer in {build(args.dir, seed=args.seed, pretrain_steps=args.pretrain_steps)}")
    return 0


def _cmd_lab(args: argparse.Namespace) -> int:
    """JupyterLab on the project, the dsr1kit kernel, the notebooks folder open; runs until stopped."""
    import os
    import secrets
    import signal
    import subprocess
    import time
    import urllib.request

    from .cluster.rendezvous import free_port
    from .run.report import ensure_kernelspec

    kernel = ensure_kernelspec()  # the kernel runs this venv's Python, whatever Jupyter finds first
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    port = args.port or free_port(args.ip)
    extra = args.jupyter_args[1:] if args.jupyter_args[:1] == ["--"] else args.jupyter_args
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.no_browser_open_file=True",
           f"--ServerApp.root_dir={PROJECT_ROOT}", f"--ServerApp.ip={args.ip}", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", "--ServerApp.default_url=/lab/tree/notebooks",
           f"--MappingKernelManager.default_kernel_name={kernel}", *extra]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    # The token travels in the environment (Jupyter reads JUPYTER_TOKEN): not in argv, not in a file.
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env={**os.environ, "JUPYTER_TOKEN": token})
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    host = f"[{args.ip}]" if ":" in args.ip else args.ip
    base = f"http://{host}:{port}"
    deadline = time.monotonic() + args.timeout
    try:
        while proc.poll() is None:
            try:
                req = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
                urllib.request.urlopen(req, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"error: JupyterLab did not answer on {base} within {args.timeout:.0f} s", file=sys.stderr)
                    proc.terminate()
                    break
                time.sleep(0.3)
        if proc.poll() is None:
            print(f"\nJupyterLab on {PROJECT_ROOT}, kernel '{kernel}' (this environment). Open:\n\n"
                  f"    {base}/lab/tree/notebooks?token={token}\n\n"
                  f"Stop with Ctrl-C twice.", flush=True)
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # Jupyter got it too: it asks to confirm, a second Ctrl-C stops it
                continue
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsr1kit", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="execute a notebook into a run folder (report.ipynb/.html)")
    run.add_argument("notebook")
    run.add_argument("-f", "--params-file", action="append", default=[], help="YAML parameters (repeatable)")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                     help="override one parameter; VALUE is parsed as YAML")
    run.add_argument("--runs-dir", default="runs", help="where run folders go")
    run.add_argument("--run-dir", default=None, help="exact run folder (e.g. to resume a requeued job)")
    run.add_argument("-q", "--quiet", action="store_true", help="do not stream cell output")
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser("demo", help="run notebooks 00-30 on the embedded tiny model (HARI on task B, "
                                       "scored on B and A)")
    demo.add_argument("--runs-dir", default="runs")
    demo.add_argument("-q", "--quiet", action="store_true")
    demo.add_argument("--notebooks-dir", default=str(PROJECT_ROOT / "notebooks"), help="where the notebooks are")
    demo.set_defaults(func=_cmd_demo)

    plan = sub.add_parser("plan", help="memory plan of a params file's step (per GPU and host); runs nothing",
                          description="Bytes per GPU and on the host for the step a params file configures, "
                                      "from the model's config alone. Exit status 3 when it does not fit.")
    plan.add_argument("params_file")
    plan.add_argument("-f", "--params-file", dest="extra_file", action="append", default=[],
                      help="more YAML layered on top (repeatable)")
    plan.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    plan.add_argument("--notebook", default=None, help="notebook name when the file name does not say it")
    plan.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this node's)")
    plan.add_argument("--gpu-gib", type=float, default=None, help="memory per GPU, GiB (default: this node's)")
    plan.add_argument("--host-gib", type=float, default=None, help="host memory available, GiB (default: this node's)")
    plan.set_defaults(func=_cmd_plan)

    runs = sub.add_parser("runs", help="list run folders with status and headline metric")
    runs.add_argument("--runs-dir", default="runs")
    runs.set_defaults(func=_cmd_runs)

    tiny = sub.add_parser("tiny", help="build the embedded tiny DeepSeek-V3 into DIR")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--pretrain-steps", type=int, default=None, help="default: the embedded model's")
    tiny.set_defaults(func=_cmd_tiny)

    lab = sub.add_parser("lab", help="JupyterLab on the project with the dsr1kit kernel; prints the URL with its token",
                         description="Start JupyterLab on the project root with the notebooks folder open and "
                                     "the 'dsr1kit' kernel (this environment). The token is $JUPYTER_TOKEN, "
                                     "else a random one; it is printed, not written into any project or config file. "
                                     "Arguments after -- go to `jupyter lab` verbatim.")
    lab.add_argument("--ip", default="127.0.0.1", help="address to listen on (a cluster node: tunnel, or 0.0.0.0)")
    lab.add_argument("--port", type=int, default=0, help="port; 0 = a free one")
    lab.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the server to answer")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="-- then extra `jupyter lab` arguments")
    lab.set_defaults(func=_cmd_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
