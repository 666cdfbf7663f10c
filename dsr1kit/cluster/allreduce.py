"""An all-reduce across every rank: is the sum right, and what bus bandwidth does it reach?

NCCL on GPUs (one GPU per process: with one process per node this measures the
inter-node link), gloo on CPU. Bus bandwidth follows nccl-tests:
``busbw = bytes / time * 2 (n - 1) / n``, comparable to the link's rating.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from .checks import FAIL, PASS, WARN, Row, node_name
from .rendezvous import stop_process_group

MIB = 2**20


def bus_factor(world_size: int) -> float:
    """Data each rank sends per byte reduced, for a ring all-reduce: 2 (n - 1) / n."""
    return 2 * (world_size - 1) / world_size


def run(
    rank: int,
    world_size: int,
    init_method: str,
    sizes_mib: list[float],
    timeout_s: float = 120,
    local_rank: int = 0,
    iters: int = 5,
    warmup: int = 2,
) -> dict[str, Any]:
    """Join the group, time `iters` all-reduces per size and verify one exact sum. Never raises:
    a failure to join or a crash is returned as ``{"error": ...}`` so every rank still reports."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    out: dict[str, Any] = {
        "backend": backend,
        "world_size": world_size,
        "rank": rank,
        "init_method": init_method,
        "results": [],
    }
    t0 = time.monotonic()
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=dt.timedelta(seconds=timeout_s),
        )
    except Exception as err:  # noqa: BLE001 - reported as a failing row, with the time it took
        out["error"] = (
            f"joining {init_method} as rank {rank}/{world_size} failed after "
            f"{time.monotonic() - t0:.0f} s: {type(err).__name__}: {err}"
        )
        return out
    try:
        for size in sizes_mib:
            out["results"].append(_measure(size, rank, world_size, device, iters, warmup))
    except Exception as err:  # noqa: BLE001
        out["error"] = f"all-reduce failed on rank {rank}: {type(err).__name__}: {err}"
    finally:
        stop_process_group()
    return out


def _measure(size_mib: float, rank: int, world_size: int, device, iters: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    numel = max(1, int(size_mib * MIB) // 4)
    # A pattern whose sum is exact in fp32: (i % 251) + rank on every rank.
    pattern = torch.arange(numel, device=device, dtype=torch.float32).remainder_(251)
    probe = pattern + rank
    dist.all_reduce(probe)
    expected = pattern * world_size + world_size * (world_size - 1) / 2
    correct = bool(torch.equal(probe, expected))
    buf = torch.ones(numel, device=device, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(buf)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    seconds = (time.perf_counter() - t0) / iters
    algbw = numel * 4 / seconds / 1e9
    return {
        "size_mib": size_mib,
        "time_ms": round(seconds * 1e3, 3),
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * bus_factor(world_size), 3),
        "correct": correct,
    }


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def peak(result: dict[str, Any]) -> dict[str, Any] | None:
    """The size with the highest bus bandwidth (small messages are latency-bound)."""
    return max(result.get("results") or [], key=lambda r: r["busbw_gbps"], default=None)


def correctness_row(result: dict[str, Any]) -> Row:
    """Every rank checks its own sum, so a rank that got wrong data is named."""
    n, rank = result["world_size"], result["rank"]
    where = f"rank {rank} of {n} ({result['backend']})"
    if "error" in result:
        return Row(
            "all-reduce",
            FAIL,
            result["error"],
            "every rank joins and sums correctly",
            "check that every node reaches MASTER_ADDR:MASTER_PORT (firewall, host resolution), the "
            "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME rows, and rerun with NCCL_DEBUG=INFO",
            node_name(),
        )
    wrong = [r["size_mib"] for r in result["results"] if not r["correct"]]
    if wrong:
        return Row(
            "all-reduce",
            FAIL,
            f"{where}: wrong sum at {', '.join(f'{s:g}' for s in wrong)} MiB",
            "exact sums",
            "a broken link or driver: run nccl-tests between these nodes and report the node to the admins",
            node_name(),
        )
    sizes = ", ".join(f"{r['size_mib']:g}" for r in result["results"])
    return Row("all-reduce", PASS, f"{where}: correct at {sizes} MiB", "exact sums", "", node_name())


def bandwidth_row(result: dict[str, Any], expected_busbw_gbps: float) -> Row:
    """Peak bus bandwidth against the params' figure: below half fails, below it warns."""
    name = "all-reduce bus bandwidth"
    best = peak(result)
    if "error" in result or best is None:
        return Row(
            name,
            FAIL,
            "not measured (the all-reduce failed)",
            "a measurement",
            "see the all-reduce row",
            node_name(),
        )
    n = result["world_size"]
    if n == 1:
        return Row(name, PASS, "world size 1: nothing crosses a link", "-", "", node_name())
    measured = f"{best['busbw_gbps']:.2f} GB/s at {best['size_mib']:g} MiB ({result['backend']}, {n} ranks)"
    if expected_busbw_gbps <= 0:
        return Row(name, PASS, measured, "no target (expected_busbw_gbps 0)", "", node_name())
    expected = f">= {expected_busbw_gbps:g} GB/s"
    ratio = best["busbw_gbps"] / expected_busbw_gbps
    if ratio >= 1:
        return Row(name, PASS, measured, expected, "", node_name())
    fix = (
        "NCCL is likely on TCP, not InfiniBand: check the network interface row, NCCL_IB_HCA and "
        "NCCL_DEBUG=INFO output ('NET/IB' vs 'NET/Socket'); try larger allreduce_sizes_mib"
    )
    return Row(
        name,
        FAIL if ratio < 0.5 else WARN,
        measured + f" = {ratio:.0%} of target",
        expected,
        fix,
        node_name(),
    )
