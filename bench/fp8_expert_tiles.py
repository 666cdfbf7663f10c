"""Tile sweep of the kit's grouped FP8 expert GEMM at R1's widths, beside the autotuned route the kit runs.

    python -m bench.fp8_expert_tiles --out fp8_expert_tiles.json             # one H100 / H200 (~3 min, compiles)
    python -m bench.fp8_expert_tiles --tokens 4096 --budget-s 120 --out t.json

R1's routed experts (256 × width 2048, hidden 7168, top 8) as stored (e4m3,
128×128 block scales; random values: the timings do not depend on them), for
``--tokens`` tokens routed uniformly at random. The two grouped GEMMs the
experts run (gate/up: rows gathered from the tokens, N = 4096, K = 7168;
down: N = 7168, K = 2048, rows scattered to their (token, k) slots) are timed
alone for every tile configuration of the grid below (row tile × column tile
× warps × pipeline stages), with ``triton.testing.do_bench``
(median). Beside them: ``fp8_kernels.experts`` as the kit runs it (autotuned
over ``fp8_kernels``'s own configurations, activation quantization and the
fused SiLU·up included). A configuration that does not compile (shared
memory) is recorded with its error. Rows are written as they come, so a run
stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from dsr1kit.model import fp8_kernels
from dsr1kit.model.expert_tiles import expert_tiles
from dsr1kit.model.fp8 import FP8_DTYPE

EXPERTS, HIDDEN, INTER, TOP_K = 256, 7168, 2048, 8


def fp8_weights(shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(shape, device=device, dtype=torch.bfloat16) * 64).clamp(-448, 448).to(FP8_DTYPE)
    grid = (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
    return w, torch.rand(grid, device=device, dtype=torch.float32) * 1e-3 + 1e-4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--budget-s", type=float, default=400, help="stop sweeping after this many seconds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from triton.testing import do_bench

    device = torch.device("cuda")
    torch.manual_seed(0)
    t = args.tokens
    gate_up, gate_up_s = fp8_weights((EXPERTS, 2 * INTER, HIDDEN), device)
    down, down_s = fp8_weights((EXPERTS, HIDDEN, INTER), device)
    hidden = torch.randn(t, HIDDEN, device=device, dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(EXPERTS, device=device)[:TOP_K] for _ in range(t)])
    weights = torch.rand(t, TOP_K, device=device).softmax(-1)
    q, s = fp8_kernels.quantize(hidden)
    flops_gate_up = 2 * t * TOP_K * HIDDEN * 2 * INTER
    flops_down = 2 * t * TOP_K * INTER * HIDDEN
    record = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "tokens": t,
        "rows": [],
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

    kit_ms = do_bench(
        lambda: fp8_kernels.experts(hidden, index, weights, gate_up, gate_up_s, down, down_s, INTER)
    )
    record["kit_experts_ms"] = round(kit_ms, 3)
    record["kit_experts_tflops"] = round((flops_gate_up + flops_down) / kit_ms / 1e9, 1)
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}), flush=True)
    save()

    grid = itertools.product((64, 128), (128, 256), (4, 8), (3, 4, 5), (8,))
    started = time.monotonic()
    tiles = {}
    for block_m, block_n, warps, stages, group_m in grid:
        if time.monotonic() - started > args.budget_s:
            record["stopped"] = f"budget of {args.budget_s} s spent"
            break
        if block_m not in tiles:
            rows, block_expert = expert_tiles(index, EXPERTS, block_m)
            act = torch.randn(rows.numel(), INTER, device=device, dtype=torch.bfloat16)
            aq, a_s = fp8_kernels.quantize(act)
            tiles[block_m] = (rows, block_expert, aq, a_s)
        rows, block_expert, aq, a_s = tiles[block_m]
        bound = rows.numel()
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, GROUP_M=group_m)
        row = dict(cfg)
        gate_up_out = torch.empty(bound, 2 * INTER, device=device, dtype=torch.bfloat16)
        slots = torch.empty(t * TOP_K, HIDDEN, device=device, dtype=torch.bfloat16)
        route_w = weights.reshape(-1).float().contiguous()
        try:
            gu_args = (q, s, gate_up, gate_up_s, gate_up_out, bound, 2 * INTER, HIDDEN, 1, rows, block_expert)
            dn_args = (aq, a_s, down, down_s, slots, bound, HIDDEN, INTER, 2, rows, block_expert, route_w)
            tile = dict(top_k=TOP_K, config=cfg)
            ms_gu = do_bench(functools.partial(fp8_kernels.launch, *gu_args, **tile))
            ms_dn = do_bench(functools.partial(fp8_kernels.launch, *dn_args, **tile))
            row.update(
                gate_up_ms=round(ms_gu, 3),
                gate_up_tflops=round(flops_gate_up / ms_gu / 1e9, 1),
                down_ms=round(ms_dn, 3),
                down_tflops=round(flops_down / ms_dn / 1e9, 1),
            )
        except Exception as err:  # noqa: BLE001 - a tile that does not fit is a row, not the end of the sweep
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
    ok = [r for r in record["rows"] if "error" not in r]
    for part in ("gate_up", "down"):
        best = min(ok, key=lambda r: r[f"{part}_ms"]) if ok else None
        record[f"best_{part}"] = best
        print(f"best {part}: {json.dumps(best)}", flush=True)
    save()


if __name__ == "__main__":
    main()
