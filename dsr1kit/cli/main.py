"""The kit's command line: `dsr1kit run | demo | plan | stage | runs | tiny | lab | train | rank-check |
parameters-cell`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..run.paths import PROJECT_ROOT
from ..steps.parameters import ParamsError
from . import jobs
from .args import add_params_options, load_params, overrides
from .lab import cmd_lab
from .stage import add_stage

DEMO_ORDER = ("00_cluster_check", "20_hari_training", "10_vllm_inference", "30_adapter_inspection")


def _cmd_run(args: argparse.Namespace) -> int:
    from ..run.report import NotebookFailed, find_notebook, run_notebook
    from ..steps import parameters as params
    from ..steps import preflight

    values = overrides(args)
    try:
        notebook = find_notebook(args.notebook)
        p = params.load(notebook, args.params_file, values)
        preflight.check(notebook, p)
        result = run_notebook(
            notebook,
            p.to_dict(),
            args.params_file,
            values,
            runs_root=args.runs_dir,
            run_dir=args.run_dir,
            log_output=not args.quiet,
        )
    except (ParamsError, preflight.BadInput, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NotebookFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"report: {result.run_dir / 'report.html'} ({result.status['status']}, "
        f"{result.status['duration_s']} s)"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Every notebook on the embedded tiny model, in pipeline order: the tiny set, plus params/demo's
    layer where a notebook has one (HARI on task B, then base vs adapter scored on B and on A)."""
    from ..run.report import NotebookFailed, run_notebook
    from ..steps import parameters as params

    failed = 0
    done = []
    for name in DEMO_ORDER:
        nb = Path(args.notebooks_dir) / f"{name}.ipynb"
        prm = [PROJECT_ROOT / "params" / "tiny" / f"{name}.yaml"]
        overlay = (
            PROJECT_ROOT / "params" / "demo" / f"{name}.yaml"
        )  # the demo's task: train on B, score B and A
        if overlay.is_file():
            prm.append(overlay)
        if not nb.is_file():  # a broken checkout: say so instead of running a shorter demo
            failed += 1
            print(f"error: {nb} is missing (restore it: git checkout -- {nb})", file=sys.stderr)
            done.append((name, "MISSING", nb))
            continue
        print(f"== {name}", flush=True)
        try:
            result = run_notebook(
                nb, params.load(nb, prm).to_dict(), prm, runs_root=args.runs_dir, log_output=not args.quiet
            )
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
    from ..plan import GIB, Machine
    from ..steps.plans import disk_plan_for, plans_for

    files = [args.first_file, *args.params_file]
    notebook = args.notebook or Path(args.first_file).stem
    p = load_params(notebook, args, files)
    if p is None:
        return 2
    machine = Machine.detect().with_overrides(args.gpus, args.gpu_gib, args.host_gib)
    plans = plans_for(notebook, p, machine)
    free = args.disk_free_gib * GIB if args.disk_free_gib is not None else None
    disk = disk_plan_for(notebook, p, args.run_dir, free)
    plans += [disk] if disk is not None else []
    if notebook == "20_hari_training":  # the one step whose rates the benchmarks measured at R1's widths
        from ..steps.hari_training import configure, time_plan

        print(time_plan(configure(p), machine, nodes=args.nodes).text(), end="\n\n")
    command_ok = True
    if notebook == "10_vllm_inference":  # the server line, before an allocation waits on it
        from ..infer.vllm_checks import planned_command
        from ..steps.serve_configs import serve_settings

        text, command_ok = planned_command(serve_settings(p, args.nodes), p.model)
        print(text, end="\n\n")
        from ..steps.vllm_inference import eval_cost

        try:
            print(eval_cost(p, args.rate_from).text(), end="\n\n")
        except ValueError as err:
            print(f"error: --rate-from: {err}", file=sys.stderr)
            return 2
    if not plans:
        print(f"{notebook} loads no model and writes little: nothing to plan")
    for plan in plans:
        print(plan.text() if plan.fits else plan.refusal(), end="\n\n")
    return 0 if command_ok and all(pl.fits for pl in plans) else 3


def _cmd_runs(args: argparse.Namespace) -> int:
    from ..run.report import format_runs, list_runs

    print(format_runs(list_runs(args.runs_dir)))
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from ..embedded.tiny import build

    print(
        f"tiny model and tokenizer in {build(args.dir, seed=args.seed, pretrain_steps=args.pretrain_steps)}"
    )
    return 0


def _cmd_parameters_cell(args: argparse.Namespace) -> int:
    from ..run import parameters_cell
    from ..steps import parameters as params

    paths = args.notebooks or sorted(parameters_cell.NOTEBOOKS_DIR.glob("*.ipynb"))
    for path in paths:
        model = params.model_for_stem(path.stem)
        if model is not None:
            changed = parameters_cell.write(path, model)
            print(f"{path}: {'rewritten' if changed else 'up to date'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsr1kit", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="execute a notebook into a run folder (report.ipynb/.html)")
    run.add_argument("notebook")
    add_params_options(
        run, run_dir="optional", run_dir_help="exact run folder (e.g. to resume a requeued job)"
    )
    run.add_argument("--runs-dir", default="runs", help="where run folders go")
    run.add_argument("-q", "--quiet", action="store_true", help="do not stream cell output")
    run.set_defaults(func=_cmd_run)

    demo = sub.add_parser(
        "demo", help="run notebooks 00-30 on the embedded tiny model (HARI on task B, scored on B and A)"
    )
    demo.add_argument("--runs-dir", default="runs")
    demo.add_argument("-q", "--quiet", action="store_true")
    demo.add_argument(
        "--notebooks-dir", default=str(PROJECT_ROOT / "notebooks"), help="where the notebooks are"
    )
    demo.set_defaults(func=_cmd_demo)

    plan = sub.add_parser(
        "plan",
        help="memory and disk plan of a params file's step (per GPU, host and filesystem); runs nothing",
        description="Bytes per GPU and on the host for the step a params file configures, "
        "from the model's config alone, and the bytes it writes against the free space of each "
        "filesystem it writes to. Exit status 3 when one does not fit.",
    )
    plan.add_argument(
        "first_file", metavar="params_file", help="the step's YAML (its name says the notebook)"
    )
    add_params_options(plan)
    plan.add_argument("--notebook", default=None, help="notebook name when the file name does not say it")
    plan.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this node's)")
    plan.add_argument(
        "--gpu-gib", type=float, default=None, help="memory per GPU, GiB (default: this node's)"
    )
    plan.add_argument(
        "--host-gib", type=float, default=None, help="host memory available, GiB (default: this node's)"
    )
    plan.add_argument(
        "--disk-free-gib",
        type=float,
        default=None,
        help="free space of every filesystem written to, GiB (default: each one's, measured here)",
    )
    plan.add_argument(
        "--run-dir", default=None, help="the run folder the step will write (default: a new one)"
    )
    plan.add_argument(
        "--rate-from",
        default=None,
        metavar="RUN_DIR",
        help="notebook 10: an earlier evaluation's run folder whose measured tokens per answer and tokens/s "
        "price this one (expected tokens and hours)",
    )
    plan.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes of the job, for the time plan and the vLLM command (default: this job's, or 1)",
    )
    plan.set_defaults(func=_cmd_plan)

    add_stage(sub)

    runs = sub.add_parser("runs", help="list run folders with status and headline metric")
    runs.add_argument("--runs-dir", default="runs")
    runs.set_defaults(func=_cmd_runs)

    tiny = sub.add_parser("tiny", help="build the embedded tiny DeepSeek-V3 into DIR")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--pretrain-steps", type=int, default=None, help="default: the embedded model's")
    tiny.set_defaults(func=_cmd_tiny)

    lab = sub.add_parser(
        "lab",
        help="JupyterLab on the project with the dsr1kit kernel; prints the URL with its token",
        description="Start JupyterLab on the project root with the notebooks folder open and "
        "the 'dsr1kit' kernel (this environment). The token is $JUPYTER_TOKEN, "
        "else a random one; it is printed, not written into any project or config file. "
        "Arguments after -- go to `jupyter lab` verbatim.",
    )
    lab.add_argument(
        "--ip", default="127.0.0.1", help="address to listen on (a cluster node: tunnel, or 0.0.0.0)"
    )
    lab.add_argument("--port", type=int, default=0, help="port; 0 = a free one")
    lab.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the server to answer")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="-- then extra `jupyter lab` arguments")
    lab.set_defaults(func=cmd_lab)

    jobs.add_train(sub)
    jobs.add_rank_check(sub)
    jobs.add_sweep_point(sub)

    cell = sub.add_parser(
        "parameters-cell",
        help="rewrite notebooks' parameters cells from dsr1kit.params",
        description="Render each notebook's parameters cell from its typed model (the one "
        "place a default and its help live) and rewrite the committed cell.",
    )
    cell.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook under notebooks/")
    cell.set_defaults(func=_cmd_parameters_cell)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
