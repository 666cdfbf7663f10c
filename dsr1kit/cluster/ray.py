"""Ray across nodes: wait for every node, inspect, stop.

Starting Ray lives in one place, slurm/ray_cluster.sh (its flags are what jobs
run; the tests start nodes through the same helper). Looking at a cluster
happens in a short-lived subprocess (a Ray driver can hang or leave threads
behind; a notebook kernel or pytest should not).

    python -m dsr1kit.cluster.ray wait  --address IP:PORT --nodes 2 [--gpus 16] [--timeout 300]
    python -m dsr1kit.cluster.ray state --address IP:PORT
    python -m dsr1kit.cluster.ray stop  --temp-dir DIR [--all]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .checks import FAIL, PASS, Row


class RayClusterIncomplete(RuntimeError):
    """Not every expected node (or GPU) joined before the timeout; the message names who is missing."""


# -- looking at a running cluster -------------------------------------------------------------
def cluster_state(address: str, node_ip: str | None = None, timeout: float = 60) -> dict[str, Any]:
    """Alive nodes and total resources, from a driver in a subprocess that connects from `node_ip`
    (an address of a Ray node on this host; default: the head's)."""
    host, _, port = address.rpartition(":")
    node_ip = node_ip or host
    try:  # a refused port answers at once; a driver would retry for minutes
        socket.create_connection((host, int(port)), timeout=min(10.0, timeout)).close()
    except (OSError, ValueError) as err:
        return {"address": address, "error": f"nothing answers at {address} ({err})", "nodes": []}
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsr1kit.cluster.ray",
                "_state",
                "--address",
                address,
                "--node-ip",
                node_ip,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {
            "address": address,
            "error": f"no answer from Ray at {address} within {timeout:g} s",
            "nodes": [],
        }
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"address": address, "error": f"cannot connect to Ray at {address}: {tail}", "nodes": []}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _state_in_driver(address: str, node_ip: str) -> dict[str, Any]:
    import ray

    ray.init(
        address=address,
        _node_ip_address=node_ip,
        logging_level="ERROR",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        nodes = [
            {
                "ip": n["NodeManagerAddress"],
                "hostname": n["NodeManagerHostname"],
                "cpus": n["Resources"].get("CPU", 0),
                "gpus": n["Resources"].get("GPU", 0),
                "head": "node:__internal_head__" in n["Resources"],
            }
            for n in ray.nodes()
            if n["Alive"]
        ]
        total = ray.cluster_resources()
    finally:
        ray.shutdown()
    return {
        "address": address,
        "nodes": sorted(nodes, key=lambda n: (not n["head"], n["ip"])),
        "cpus": total.get("CPU", 0),
        "gpus": total.get("GPU", 0),
    }


def missing_nodes(state: dict[str, Any], expected: list[tuple[str, str | None]]) -> list[str]:
    """Expected (name, ip or None) not seen alive: matched by IP when known, else by host name."""
    ips = {n["ip"] for n in state["nodes"]}
    hosts = {n["hostname"].split(".")[0] for n in state["nodes"]}
    return [
        f"{name} ({ip})" if ip else name
        for name, ip in expected
        if (ip not in ips if ip else name.split(".")[0] not in hosts)
    ]


def expected_from_slurm() -> list[tuple[str, str | None]]:
    """The job's nodes with their Ray IP when it is known here (the DSR1KIT_NODE_IPS override)."""
    from .slurm import NODE_IPS_ENV, SlurmJob

    job = SlurmJob.from_env()
    if job is None:
        return []
    ips = os.environ.get(NODE_IPS_ENV, "").split()
    return [(h, ips[i] if i < len(ips) else None) for i, h in enumerate(job.hostnames)]


def wait_for_cluster(
    address: str,
    nodes: int,
    gpus: int = 0,
    expected: list[tuple[str, str | None]] | None = None,
    node_ip: str | None = None,
    timeout: float = 300,
    poll: float = 2,
) -> dict[str, Any]:
    """Poll until `nodes` nodes (and `gpus` GPUs) are alive; raise RayClusterIncomplete naming who is missing."""
    deadline = time.monotonic() + timeout
    while True:
        state = cluster_state(address, node_ip, timeout=max(10.0, min(60.0, deadline - time.monotonic())))
        if not state.get("error") and len(state["nodes"]) >= nodes and state["gpus"] >= gpus:
            return state
        if time.monotonic() >= deadline:
            raise RayClusterIncomplete(describe_shortfall(state, nodes, gpus, expected or [], timeout))
        time.sleep(poll)


def describe_shortfall(
    state: dict[str, Any], nodes: int, gpus: int, expected: list[tuple[str, str | None]], waited: float
) -> str:
    if state.get("error"):
        return f"after {waited:g} s: {state['error']}"
    joined = ", ".join(f"{n['ip']} ({n['hostname']})" for n in state["nodes"]) or "none"
    msg = f"after {waited:g} s {len(state['nodes'])} of {nodes} nodes joined Ray at {state['address']}: {joined}"
    missing = missing_nodes(state, expected)
    if missing:
        msg += f"; missing: {', '.join(missing)}"
    if state["gpus"] < gpus:
        msg += f"; {state['gpus']:g} of {gpus} GPUs"
    return msg


def ray_rows(
    state: dict[str, Any], nodes: int, gpus: int = 0, expected: list[tuple[str, str | None]] | None = None
) -> list[Row]:
    """Rows for the report: did every node join, are the GPUs there."""
    fix = (
        "read the Ray logs under the job's RAY_TMP_ROOT/ray-JOBID-* dirs; check that workers reach the head's "
        "IP and port (firewall, advertised ip row); recovery: slurm/ray_cluster.sh down, then up"
    )
    if state.get("error"):
        return [Row("ray nodes", FAIL, state["error"], f"{nodes} nodes", fix, "cluster")]
    names = {ip: name for name, ip in expected or [] if ip}
    joined = ", ".join(
        " ".join(filter(None, [names.get(n["ip"]), n["ip"], "(head)" if n["head"] else ""]))
        for n in state["nodes"]
    )
    ok = len(state["nodes"]) >= nodes
    rows = [
        Row(
            "ray nodes",
            PASS if ok else FAIL,
            f"{len(state['nodes'])} alive: {joined}",
            f"{nodes} nodes",
            ""
            if ok
            else describe_shortfall(state, nodes, 0, expected or [], 0).split(": ", 1)[-1] + " → " + fix,
            "cluster",
        )
    ]
    if gpus:
        ok = state["gpus"] >= gpus
        rows.append(
            Row(
                "ray gpus",
                PASS if ok else FAIL,
                f"{state['gpus']:g} GPUs, {state['cpus']:g} CPUs",
                f"{gpus} GPUs",
                ""
                if ok
                else "start every worker on a node with its GPUs visible "
                "(--gpus-per-node in the job; CUDA_VISIBLE_DEVICES not narrowed)",
                "cluster",
            )
        )
    return rows


# -- stopping ------------------------------------------------------------------------------
def _holders(temp_dir: Path) -> list[int]:
    """Processes of this Ray node: its temp dir in their command line or among their open files
    (never this process or its ancestors)."""
    marker = str(temp_dir.resolve())
    in_cmdline = re.compile(re.escape(marker.encode()) + rb"(?=/|\x00|$)")
    spared = _ancestors()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            if in_cmdline.search((entry / "cmdline").read_bytes()):
                pids.append(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                link = os.readlink(fd)
                if link == marker or link.startswith(marker + "/"):
                    pids.append(int(entry.name))
                    break
        except OSError:
            continue
    return pids


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _terminate(pids: list[int], grace_s: float) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)


def _is_blocking_start(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in argv and b"--block" in argv


def stop(temp_dir: str | Path, all_ray: bool = False, grace_s: float = 3) -> list[int]:
    """Stop the Ray node that uses `temp_dir`, optionally `ray stop --force` for every Ray process of
    this user on the host, then remove the temp dir. Returns the stopped PIDs.

    A worker's `ray start --block` goes first: on SIGTERM it drains its node and ends its own
    processes; whatever is left then gets SIGTERM, and SIGKILL after `grace_s`."""
    temp_dir = Path(temp_dir)
    pids = _holders(temp_dir) if temp_dir.exists() else []
    _terminate([p for p in pids if _is_blocking_start(p)], grace_s=15)
    _terminate([p for p in pids if _alive(p)], grace_s)
    if all_ray:
        subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, timeout=120
        )
    shutil.rmtree(temp_dir, ignore_errors=True)
    return pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsr1kit.cluster.ray", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until every node joined; exit 1 naming who is missing")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=int, default=0)
    w.add_argument("--timeout", type=float, default=300)
    for name in ("state", "_state"):
        s = sub.add_parser(
            name, help="alive nodes and resources as JSON" if name == "state" else argparse.SUPPRESS
        )
        s.add_argument("--address", required=True)
        s.add_argument("--node-ip", default=None)
    st = sub.add_parser("stop", help="stop the Ray node using --temp-dir and remove the dir")
    st.add_argument("--temp-dir", required=True)
    st.add_argument("--all", action="store_true", help="also `ray stop --force` (every Ray process here)")
    args = parser.parse_args(argv)
    if args.cmd == "_state":
        print(json.dumps(_state_in_driver(args.address, args.node_ip or args.address.rsplit(":", 1)[0])))
    elif args.cmd == "state":
        print(json.dumps(cluster_state(args.address, args.node_ip), indent=1))
    elif args.cmd == "wait":
        try:
            state = wait_for_cluster(
                args.address, args.nodes, args.gpus, expected_from_slurm(), timeout=args.timeout
            )
        except RayClusterIncomplete as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(
            f"ray: {len(state['nodes'])} nodes, {state['cpus']:g} CPUs, {state['gpus']:g} GPUs at {args.address}"
        )
    else:
        pids = stop(args.temp_dir, all_ray=args.all)
        print(
            f"ray stopped on {os.environ.get('SLURMD_NODENAME', os.uname().nodename)}: {len(pids)} processes, "
            f"{args.temp_dir} removed" + (", ray stop --force" if args.all else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
