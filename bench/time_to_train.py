"""Time to train a HARI workload on R1, cached vs whole-model steps, from measured per-GPU rates.

    python -m bench.time_to_train --measured docs/results/hari_cached.h200.json
    python -m bench.time_to_train --measured hari_cached.json --tokens 53.7e6 --nodes 2 --gpus-per-node 8 --epochs 10
    python -m bench.time_to_train --prefix-fp8 docs/results/prefix_fp8.h100.json \
        --cached-step docs/results/cached_profile_reference_cached.bf16.h100.json    # the latest kernels' rates

Nothing runs on a GPU here: the rates come from ``bench.hari_cached``'s JSON
(one H200, R1 widths) and the whole-model step from the 61-layer run on 4 H200s
recorded there. Every line of arithmetic is printed, so the table can be
checked by hand and redone for another data plan (``--tokens``: the tokens per
epoch, prompts included), machine or number of epochs.

Paths compared:

- whole model (today's default): one process per node, the 61 layers over the
  node's GPUs through a device_map, so one GPU works at a time; nodes are data
  parallel. More GPUs per node hold the model but do not speed a step up.
- prefix cache: epoch 1 runs the prefix pass once (forward only, NF4, or FP8
  as stored with ``--prefix-fp8``; the node's GPUs as a wavefront: ideal = every GPU busy; worst = one at a time,
  which is what an unpipelined device_map gives), then every epoch trains with
  one process per GPU on the cached states (the bf16 last layer). With a
  ``--cached-step`` JSON that times the KL's reference both ways, epoch 1 also
  runs the reference pass (the adapted layers forward, once per sample, every
  GPU on its share), and the cache holds and reads twice the bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def fp8_prefix_rate(path: Path, shape: list[int], lines: list[str]) -> float:
    """Tokens/s per GPU of R1's 60-layer prefix (3 dense + 57 MoE) from bench.prefix_fp8's layer times.

    The kit's FP8 path is the lean layer, with its rotary/key and router kernels where the kit switches them
    on by default (``LoadConfig.prefix_kernels``) and the file has that path (``fp8-lean-kernels``), else
    without (``fp8-lean``); timed back to back as the prefix pass runs its layers where the file has that.
    Older files give the ``fp8`` path, timed alone."""
    from dsr1kit.model.load import LoadConfig

    f = json.loads(path.read_text())
    rows = [r for r in f["rows"] if [r["batch"], r["seq"]] == shape]
    paths = {r["path"] for r in rows}
    wanted = ["fp8-lean-kernels"] if LoadConfig.__dataclass_fields__["prefix_kernels"].default else []
    path_name = next(p for p in [*wanted, "fp8-lean", "fp8"] if p in paths)
    mine = [r for r in rows if r["path"] == path_name]
    key = "ms_back_to_back" if all(r.get("ms_back_to_back") for r in mine) else "ms"
    ms = {r["layer"]: r[key] for r in mine}
    total = 3 * ms["dense"] + 57 * ms["moe"]
    rate = shape[0] * shape[1] / (total / 1e3)
    timing = "back to back" if key == "ms_back_to_back" else "one forward at a time"
    lines.append(
        f"prefix pass in FP8 ({f['meta']['device']}, path {path_name}, {timing}): 3 dense × {ms['dense']} ms + "
        f"57 MoE × {ms['moe']} ms = {total:,.0f} ms per {shape[0] * shape[1]:,} tokens = {rate:,.0f} tokens/s per GPU"
    )
    return rate


def cached_step_rate(path: Path, lines: list[str]) -> tuple[float, float | None, float | None]:
    """Tokens/s per GPU of the cached step from bench.cached_step_profile's JSON (timed without the profiler),
    and, where the JSON times the KL's reference both ways, tokens/s per GPU of the reference pass and of the
    step that runs the reference itself (``reference_cache: false``). Where it also times the bf16 experts
    both ways (``--compare reference,experts``), the step is the kit's experts forward's while that is on.

    With ``--compare reference`` the step is the kit's default one (the reference read from its cache); the
    difference between the two timings is the adapted layers' reference forward, which the reference pass
    runs once per sample instead of once per step."""
    from dsr1kit.model.load import LoadConfig

    f = json.loads(path.read_text())["summary"]
    routes = f["timed_without_profiler"]
    if "reference" in routes:
        ref = routes["reference"]
        timed, in_step = ref["cached"], ref["in-step"]
        forward_ms = in_step["ms_per_step"] - timed["ms_per_step"]
        ref_rate = f["seq"] / (forward_ms / 1e3)
        how = "reference read from its cache"
        # the experts forward the kit loads by default
        if "experts" in routes and LoadConfig.__dataclass_fields__["kit_experts"].default:
            timed, how = routes["experts"]["kit"], how + ", the kit's grouped experts forward"
        lines.append(
            f"cached step ({f['device']}, {f['experts']} experts, {how}): "
            f"{timed['ms_per_step']} ms per {f['seq']:,} tokens = {timed['tokens_per_s']:,.0f} tokens/s per GPU"
        )
        lines.append(
            f"reference pass (once per sample): the step with its reference in it takes {in_step['ms_per_step']} "
            f"ms, so the reference forward is {forward_ms:.2f} ms per {f['seq']:,} tokens = {ref_rate:,.0f} "
            f"tokens/s per GPU"
        )
        return timed["tokens_per_s"], ref_rate, in_step["tokens_per_s"]
    timed = (routes["loss"] if "loss" in routes else routes)["fused"]  # runs before the NF4 routes were timed
    lines.append(
        f"cached step ({f['device']}, {f['experts']} experts, fused vocabulary loss): {timed['ms_per_step']} ms "
        f"per {f['seq']:,} tokens = {timed['tokens_per_s']:,.0f} tokens/s per GPU"
    )
    return timed["tokens_per_s"], None, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default="docs/results/hari_cached.h200.json")
    ap.add_argument("--tokens", type=float, default=53.7e6, help="tokens per epoch, prompts included")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument(
        "--read-gbps",
        type=float,
        default=2.0,
        help="GB/s per node the cache's disk gives (a row where the epoch waits for the disk)",
    )
    ap.add_argument("--prefix-shape", default="4x4096", help="prefix-pass batch whose rate is used")
    ap.add_argument(
        "--prefix-fp8",
        default="",
        help="bench.prefix_fp8's JSON: the prefix pass at its FP8 per-layer times (prefix_precision fp8), "
        "in place of the NF4 ones",
    )
    ap.add_argument(
        "--cached-step",
        default="",
        help="bench.cached_step_profile's JSON: the cached step at its timed rate, in place of --measured's",
    )
    args = ap.parse_args()

    m = json.loads(Path(args.measured).read_text())
    tokens, nodes, gpn, epochs = args.tokens, args.nodes, args.gpus_per_node, args.epochs
    gpus = nodes * gpn
    cached = next(r for r in m["cached"] if r["experts"] == "bf16")
    whole = m["earlier_61_layer"]
    shape = [int(x) for x in args.prefix_shape.split("x")]
    pre = next(r for r in m["prefix_r1_extrapolation"] if r["shape"] == shape)
    bpt = m["cache_bytes_per_token"]

    print(
        f"measured on {m['device']}: cached step {cached['step_ms']} ms per {cached['seq']} tokens "
        f"({cached['tokens_per_s']:,.0f} tokens/s per GPU, peak {cached['peak_gib']} GiB); whole-model step "
        f"{whole['step_ms']} ms per {whole['seq']} tokens on {whole['gpus']} GPUs ({whole['tokens_per_s']:,.0f} "
        f"tokens/s per node); 60-layer prefix {pre['r1_60_split_ms']} ms per {pre['tokens']} tokens on one GPU "
        f"(3 dense × {pre['dense_layer_ms']} ms + 57 MoE × {pre['moe_layer_ms']} ms)\n"
    )

    lines = []
    whole_rate = nodes * whole["tokens_per_s"]
    whole_epoch = tokens / whole_rate
    lines.append(
        f"whole model: {nodes} nodes × {whole['tokens_per_s']:,.0f} tokens/s = {whole_rate:,.0f} tokens/s; "
        f"epoch = {tokens:,.0f} / {whole_rate:,.0f} = {whole_epoch:,.0f} s"
    )
    prefix_gpu = pre["r1_60_split_tokens_per_s_per_gpu"]
    if args.prefix_fp8:
        prefix_gpu = fp8_prefix_rate(Path(args.prefix_fp8), shape, lines)
    ideal_rate, serial_rate = gpus * prefix_gpu, nodes * prefix_gpu
    ideal, serial = tokens / ideal_rate, tokens / serial_rate
    lines.append(
        f"prefix pass, wavefront ideal: {gpus} GPUs × {prefix_gpu:,.0f} tokens/s = {ideal_rate:,.0f} "
        f"tokens/s; {tokens:,.0f} / {ideal_rate:,.0f} = {ideal:,.0f} s"
    )
    lines.append(
        f"prefix pass, one GPU at a time per node: {nodes} × {prefix_gpu:,.0f} = {serial_rate:,.0f} tokens/s; "
        f"{tokens:,.0f} / {serial_rate:,.0f} = {serial:,.0f} s"
    )
    step_gpu, ref_gpu, in_step_gpu = cached["tokens_per_s"], None, None
    if args.cached_step:
        step_gpu, ref_gpu, in_step_gpu = cached_step_rate(Path(args.cached_step), lines)
    ideal_prefix_only, prefix_bpt = ideal, bpt
    reference = reference_disk = 0.0
    if ref_gpu:  # the reference pass: once, after the prefix pass, every GPU on its share
        reference = tokens / (gpus * ref_gpu)
        moved = 2 * tokens * prefix_bpt  # it reads the prefix states and writes as many reference states
        reference_disk = max(reference, moved / nodes / (args.read_gbps * 1e9))
        lines.append(
            f"reference pass: {tokens:,.0f} / ({gpus} GPUs × {ref_gpu:,.0f} tokens/s) = {reference:,.0f} s, "
            f"once; on a disk of {args.read_gbps} GB/s per node it reads and writes {moved / 1e9:,.0f} GB: "
            f"max({reference:,.0f} s, {moved / 1e9:,.0f} GB / {nodes} nodes / {args.read_gbps} GB/s) = "
            f"{reference_disk:,.0f} s"
        )
        ideal, serial = ideal + reference, serial + reference
        bpt *= 2
    train_rate = gpus * step_gpu
    train_epoch = tokens / train_rate
    lines.append(
        f"cached training: {gpus} GPUs × {step_gpu:,.0f} tokens/s = {train_rate:,.0f} tokens/s; "
        f"epoch = {tokens:,.0f} / {train_rate:,.0f} = {train_epoch:,.0f} s"
    )
    size = tokens * bpt
    read = step_gpu * bpt * gpn
    what = "prefix + reference states" if ref_gpu else "prefix states"
    lines.append(
        f"cache ({what}): {tokens:,.0f} tokens × {bpt:,} B = {size / 1e9:,.0f} GB; read at {gpn} × "
        f"{step_gpu:,.0f} × {bpt:,} B = {read / 1e9:.1f} GB/s per node to keep the GPUs busy"
    )
    disk_epoch = max(train_epoch, size / nodes / (args.read_gbps * 1e9))
    lines.append(
        f"cached epoch on a disk of {args.read_gbps} GB/s per node: max({train_epoch:,.0f} s, "
        f"{size / 1e9:,.0f} GB / {nodes} nodes / {args.read_gbps} GB/s) = {disk_epoch:,.0f} s"
    )
    if in_step_gpu:  # reference_cache: false reads the prefix states alone and runs the reference in the step
        in_step_epoch = tokens / (gpus * in_step_gpu)
        in_step_disk = max(in_step_epoch, tokens * prefix_bpt / nodes / (args.read_gbps * 1e9))
        lines.append(
            f"reference in the step (reference_cache: false): epoch = {tokens:,.0f} / ({gpus} × "
            f"{in_step_gpu:,.0f}) = {in_step_epoch:,.0f} s; on that disk max({in_step_epoch:,.0f} s, "
            f"{tokens * prefix_bpt / 1e9:,.0f} GB / {nodes} nodes / {args.read_gbps} GB/s) = {in_step_disk:,.0f} s"
        )
        # reading both copies beats computing the reference while the disk delivers both in the step-only time
        even = 2 * prefix_bpt * gpn * in_step_gpu
        lines.append(
            f"the reference cache saves time per epoch where the disk reads more than {gpn} × {in_step_gpu:,.0f} "
            f"× {2 * prefix_bpt:,} B = {even / 1e9:.1f} GB/s per node (below that, reference_cache: false is faster)"
        )
    for line in lines:
        print("  " + line)

    print(f"\n| path | epoch 1 | each further epoch | {epochs} epochs | × vs whole model ({epochs} epochs) |")
    print("|---|---:|---:|---:|---:|")
    total_whole = epochs * whole_epoch
    rows = [
        ("whole model (today)", whole_epoch, whole_epoch),
        ("prefix cache, wavefront ideal", ideal + train_epoch, train_epoch),
        ("prefix cache, no overlap in the pass", serial + train_epoch, train_epoch),
        (
            f"prefix cache, wavefront ideal, cache read at {args.read_gbps} GB/s per node",
            ideal_prefix_only + reference_disk + disk_epoch,
            disk_epoch,
        ),
    ]
    if in_step_gpu:
        rows.append(
            (
                f"prefix cache, wavefront ideal, cache read at {args.read_gbps} GB/s per node, reference in the step",
                ideal_prefix_only + in_step_disk,
                in_step_disk,
            )
        )
    for name, first, further in rows:
        total = first + (epochs - 1) * further
        print(f"| {name} | {hours(first)} | {hours(further)} | {hours(total)} | {total_whole / total:.1f}× |")


if __name__ == "__main__":
    main()
