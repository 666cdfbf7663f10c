"""`python -m dsr1kit.train -f PARAMS [-p KEY VALUE]… --run-dir DIR [--prefix-only]`: HARI without a notebook.

The same steps notebook 20 runs, for scripted use and for tests that start
several ranks or kill a run mid-way. ``--check-prefix-cache`` only checks that
the cache the run would train from is complete (a job of one process per GPU
asks this once, before starting them). ``--prefix-only`` runs only this task's
share of the prefix pass (``slurm/hari_prefix.sbatch``: one task per node,
shard i to task i % tasks) and prints what it built; no process group is
formed, so tasks never wait on each other.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..data.plan import DatasetPlanError
from ..params import ParamsError, load, parse_override
from ..plan import PlanError
from .checkpoint import ResumeMismatch
from .loop import OptimizerUnavailable
from ..steps.hari_training import check_prefix_cache, prefix_only, run
from .prefix import PrefixCacheError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsr1kit.train", description=__doc__)
    ap.add_argument("-f", "--params-file", action="append", default=[])
    ap.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--prefix-only", action="store_true", help="fill this task's share of the prefix cache, then exit")
    ap.add_argument("--check-prefix-cache", action="store_true",
                    help="exit 0 when the prefix cache this run would train from is complete, else 2 with why")
    args = ap.parse_args(argv)
    overrides = {k: parse_override(v) for k, v in args.param}
    overrides["run_dir"] = args.run_dir
    try:
        p = load("20_hari_training", args.params_file, overrides)
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if args.check_prefix_cache:
            d = check_prefix_cache(p)
            print(f"prefix cache complete: {d['folder']}, {d['shards']} shards, {d['tokens']:,} tokens, "
                  f"{d['size_gib']} GiB")
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


if __name__ == "__main__":
    sys.exit(main())
