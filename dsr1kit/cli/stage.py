"""``dsr1kit stage MODEL``: put a checkpoint where jobs read it, before the job, and prove it complete."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

STAGE_HELP = """Download MODEL once from the hub into a hub cache (--to, default $HF_HUB_CACHE; an interrupted
download resumes), or copy it from a shared copy (--from: a hub cache or a model folder) into --to, in
parallel; then check it: every shard of the index present, each safetensors file as long as its header
says, every file at the size the hub (or the source) gave; --hash also compares sha256 (reads every byte).
--nodes runs the same command once on every node of the Slurm allocation (srun), each into its own --to,
all at once. --check only checks, copying nothing. A folder with {node} in it is each node's own.
Exit 0 when the copy is complete on every node, 1 when one is not (the faulty files are named), 2 on bad input."""


def add_stage(sub) -> None:
    stage = sub.add_parser(
        "stage", help="stage a model on this node or every node, and check it", description=STAGE_HELP
    )
    stage.add_argument("model", help="hub repo id (e.g. deepseek-ai/DeepSeek-R1-0528) or a model folder")
    stage.add_argument(
        "--to", default=None, help="hub cache (repo id) or folder to stage into; default $HF_HUB_CACHE"
    )
    stage.add_argument(
        "--from",
        dest="source",
        default=None,
        help="copy from this hub cache or model folder instead of the hub",
    )
    stage.add_argument("--revision", default="main", help="hub revision (branch, tag or commit)")
    stage.add_argument("--workers", type=int, default=8, help="files copied or downloaded at once")
    stage.add_argument("--hash", action="store_true", help="also compare every file's sha256 (slow)")
    stage.add_argument("--check", action="store_true", help="only check what is there")
    stage.add_argument("--nodes", action="store_true", help="on every node of this Slurm allocation (srun)")
    stage.set_defaults(func=cmd_stage)


def cmd_stage(args: argparse.Namespace) -> int:
    if args.nodes:
        return _on_every_node(args)
    from tqdm.auto import tqdm

    from ..model import staging

    node = staging.node_folder("{node}").name
    try:
        if args.check:
            cache = args.to if staging.is_repo_id(args.model) else None
            model = args.model if cache is not None or not args.to else args.to
            result = staging.check(model, cache, args.revision, args.hash)
            print(f"{node}: {result.describe()}", flush=True)
            return 0 if result.complete else 1
        with tqdm(unit="B", unit_scale=True, desc=f"stage on {node}", mininterval=5) as bar:
            staged = staging.stage(
                args.model, args.to, args.source, args.revision, args.workers, args.hash, progress=bar.update
            )
    except staging.StageError as err:
        print(f"error on {node}: {err}", file=sys.stderr)
        return 2
    print(f"{node}: {staged.describe()}", flush=True)
    if not staged.completeness.complete:
        print(
            f"error on {node}: the staged copy is not complete; run the same command again (it resumes)",
            file=sys.stderr,
        )
        return 1
    return 0


def _on_every_node(args: argparse.Namespace) -> int:
    """The same command without --nodes, one task per node of the allocation, all at once."""
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if not nodes:
        print(
            "error: --nodes needs a Slurm allocation (sbatch slurm/stage.sbatch, or salloc)", file=sys.stderr
        )
        return 2
    argv = [sys.executable, "-m", "dsr1kit", "stage", args.model, "--revision", args.revision]
    argv += ["--workers", str(args.workers)]
    for flag, value in (("--to", args.to), ("--from", args.source)):
        if value:
            argv += [flag, value]
    argv += [f for f, on in (("--hash", args.hash), ("--check", args.check)) if on]
    srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=0"]
    print(f"on {nodes} node(s): {shlex.join(argv[1:])}", flush=True)
    return subprocess.run([*srun, *argv]).returncode
