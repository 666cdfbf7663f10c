"""Steps without a notebook, for sbatch scripts and tests: ``train`` (HARI, or only the prefix pass, or only
the check that its cache is complete), ``rank-check`` (one rank of the cluster check) and ``sweep-point``
(one point of the forgetting sweep, a job array's task)."""

from __future__ import annotations

import argparse
import json
import sys

from .args import add_params_options, load_params

TRAIN_HELP = """HARI as notebook 20 runs it, without the notebook: for scripted use, for sbatch scripts and
for tests that start several ranks or kill a run mid-way. --check-prefix-cache only checks that the cache the
run would train from is complete (a job of one process per GPU asks this once, before starting them);
--prefix-only runs only this task's share of the prefix pass (slurm/hari_prefix.sbatch: one task per node,
shard i to task i % tasks) and prints what it built; no process group is formed, so tasks never wait on
each other."""


def add_train(sub) -> None:
    train = sub.add_parser(
        "train", help="HARI without a notebook (the steps of notebook 20)", description=TRAIN_HELP
    )
    add_params_options(
        train, run_dir="required", run_dir_help="the run folder (checkpoints, metrics, adapter)"
    )
    train.add_argument(
        "--prefix-only", action="store_true", help="fill this task's share of the prefix cache, then exit"
    )
    train.add_argument(
        "--check-prefix-cache",
        action="store_true",
        help="exit 0 when the prefix cache this run would train from is complete, else 2 with why",
    )
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from ..data.plan import DatasetPlanError
    from ..plan import PlanError
    from ..steps.hari_training import check_prefix_cache, prefix_only, run
    from ..train.checkpoint import ResumeMismatch
    from ..train.loop import OptimizerUnavailable
    from ..train.prefix import PrefixCacheError

    p = load_params("20_hari_training", args, run_dir=args.run_dir)
    if p is None:
        return 2
    try:
        if args.check_prefix_cache:
            d = check_prefix_cache(p)
            print(
                f"prefix cache complete: {d['folder']}, {d['shards']} shards, {d['tokens']:,} tokens, "
                f"{d['size_gib']} GiB"
            )
            return 0
        if args.prefix_only:
            print(json.dumps(prefix_only(p), default=str))
            return 0
        info = run(p)
    except (DatasetPlanError, PlanError, ResumeMismatch, OptimizerUnavailable, PrefixCacheError) as err:
        print(f"error: {err}", file=sys.stderr)  # the cause and the fix; nothing done is lost
        return 2
    print(json.dumps({k: info[k] for k in ("steps_done", "total_steps", "preempted", "hosts")}))
    return 0


def add_rank_check(sub) -> None:
    rank = sub.add_parser(
        "rank-check",
        help="one rank of the cluster check (srun runs one per node)",
        description="Node checks, GPU visibility and the all-reduce of one rank, written as "
        "OUT/rank-NNNN.json for notebook 00 to gather. Under Slurm the rank is "
        "this task's; outside it, pass --rank, --world-size and --init-method.",
    )
    rank.add_argument("--out", required=True, help="folder for rank-NNNN.json (shared by all nodes)")
    add_params_options(rank)
    rank.add_argument("--rank", type=int, help="local run: this rank (default: SLURM_PROCID)")
    rank.add_argument("--world-size", type=int, help="local run: ranks in all (default: SLURM_NTASKS)")
    rank.add_argument("--init-method", help="local run: tcp://HOST:PORT (default: the job's rendezvous)")
    rank.set_defaults(func=cmd_rank_check)


def cmd_rank_check(args: argparse.Namespace) -> int:
    from ..cluster.rank_check import run_rank
    from ..steps.cluster_check import rank_check_config

    p = load_params("00_cluster_check", args)
    if p is None:
        return 2
    try:
        run_rank(rank_check_config(p), args.out, args.rank, args.world_size, args.init_method)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def add_sweep_point(sub) -> None:
    point = sub.add_parser(
        "sweep-point",
        help="one point of the forgetting sweep (a job array task), or --count the points",
        description="One point of notebook 40's sweep, a (λ, seed) of HARI or a baseline's seed: trained on "
        "task B, then measured on A and B at the end and at each snapshot, written to "
        "RUN/points/<point>/result.json (and snapshots/step-N/result.json); one JSON line per measurement, "
        "the end last (a point with its results is never redone). --count prints the number of points (the "
        "job array's size) and runs nothing; it also checks the parameters. --replay makes the replay "
        "answers and B's mix with them (by the served base with measure_with: server); --replay-first prints "
        "1 when that must happen in a job of its own before the points train, else 0.",
    )
    add_params_options(point, run_dir="optional", run_dir_help="the sweep's run folder (needed with --point)")
    group = point.add_mutually_exclusive_group(required=True)
    group.add_argument("--point", type=int, help="the point's index (SLURM_ARRAY_TASK_ID)")
    group.add_argument("--count", action="store_true", help="print the number of points and exit")
    group.add_argument("--replay", action="store_true", help="make the replay answers and the mix, then exit")
    group.add_argument(
        "--replay-first", action="store_true", help="print 1 if --replay must run before the points, else 0"
    )
    point.set_defaults(func=cmd_sweep_point)


def cmd_sweep_point(args: argparse.Namespace) -> int:
    from ..measure import sweep_run
    from ..steps.forgetting_sweep import configure, points

    p = load_params("40_forgetting_sweep", args, run_dir=args.run_dir or "")
    if p is None:
        return 2
    todo = points(p)
    if args.count:
        print(len(todo))
        return 0
    if not args.run_dir:
        what = "--replay-first" if args.replay_first else "--replay" if args.replay else "--point"
        print(f"error: {what} needs --run-dir (the sweep's run folder)", file=sys.stderr)
        return 2
    if args.replay_first:
        print(int(sweep_run.replay_first(configure(p, args.run_dir))))
        return 0
    if args.replay:
        if "replay" not in p.baselines:
            print(
                "error: --replay: the sweep has no replay baseline (baselines: [replay, ...])",
                file=sys.stderr,
            )
            return 2
        rows = sweep_run.replay_mix(configure(p, args.run_dir))
        print(json.dumps({"mix": str(sweep_run.mix_path(args.run_dir, p.replay_ratio)), "rows": len(rows)}))
        return 0
    if not 0 <= args.point < len(todo):
        print(
            f"error: --point {args.point} is outside the sweep's {len(todo)} points (0-{len(todo) - 1})",
            file=sys.stderr,
        )
        return 2
    for result in sweep_run.run_point(
        configure(p, args.run_dir), todo[args.point]
    ):  # by step, the end of the run last
        print(json.dumps(result.to_dict()))
    return 0
