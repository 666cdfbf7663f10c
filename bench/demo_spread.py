"""How much `make demo`'s numbers move between builds of the embedded model.

The embedded model is pre-trained on the machine that first needs it (single-threaded, seeded), so one
machine always builds the same model; another CPU (other vector instructions, other float rounding in
its kernels) builds a slightly different one, and the demo's accuracies move with it. This measures the
spread over builds: for each build seed, a fresh cache, the model built with that seed, then the demo
(notebooks 00-30) on it; it prints task A and task B accuracy of the base and of the adapter, and the
range over builds that README states.

    .venv/bin/python -m bench.demo_spread --seeds 0 1 2 3 --out demo_spread.json   # ~6 min per build, 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsr1kit.embedded import tiny

CATEGORIES = ("task A", "task B")


def demo_accuracy(runs: Path) -> dict[str, float]:
    """{'base task A': …, 'adapter task B': …} from the demo's notebook-10 summary."""
    (summary,) = runs.glob("*-10_vllm_inference-*/summary.json")
    rows = json.loads(summary.read_text())["accuracy"]
    return {f"{r['model']} {r['category']}": r["accuracy"] for r in rows if r["category"] in CATEGORIES}


def one_build(seed: int, root: Path) -> dict:
    cache = root / f"cache-{seed}"
    target = cache / f"tiny-dsv3-{tiny._fingerprint()}"
    t0 = time.monotonic()
    tiny.build(target, seed=seed)
    built = time.monotonic() - t0
    runs = root / f"runs-{seed}"
    env = {**os.environ, "DSR1KIT_CACHE": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "dsr1kit", "demo", "--runs-dir", str(runs), "-q"],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"demo on build seed {seed} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return {"seed": seed, "build_s": round(built, 1), **demo_accuracy(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="demo-spread-") as root:
        for seed in args.seeds:
            rows.append(one_build(seed, Path(root)))
            print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if " task " in k]
    print("\nacross builds (min–max):")
    for k in keys:
        values = [r[k] for r in rows]
        print(f"  {k:18s} {min(values):6.1%} – {max(values):6.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"builds": rows, "cpu": _cpu()}, indent=2))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
