"""liger-kernel's fused kernels beside the kit's, at R1's widths, in one run: the CE + KL vocabulary loss and the
residual-add RMSNorm.

    python -m bench.liger_compare --out liger_compare.json                   # one H100 / H200
    python -m bench.liger_compare --tokens 4096 --iters 3 --out /tmp/l.json  # a quick look
    TRITON_INTERPRET=1 python -m bench.liger_compare --device cpu --tokens 32 --skip norm --out /tmp/l.json
        # the loss's values and gradients at R1's widths on a CPU, untimed (Triton's interpreter runs the kernels;
        # liger's JSD then projects bf16 logits, its GPU path float32 ones)

liger-kernel is not one of the kit's requirements: install it where this runs (``pip install liger-kernel``).

**The vocabulary loss.** Hidden 7168, vocabulary 129,280, bf16, the lm_head frozen (as in HARI); the inputs are
the final norm's output for the student (``x``) and for the reference (``xr``), and the loss is the kit's

    CE over positions with a target (mean) + λ·T²·KL(softmax(r/T) ‖ softmax(z/T)) over the selected positions
    (mean),   z = x·Wᵀ, r = xr·Wᵀ,   λ = 0.9, T = 1.5

with its gradient to ``x``. Each way runs the forward and the backward to ``x``:

- ``kit fused``: chunks of 1,024 positions, both chunks' logits in bf16 (the lm_head's GEMM), the kit's Triton
  kernel for the terms and the logits' gradient, then the gradient's GEMM (what ``hari.chunk_terms_and_grad``
  does, minus the final norm, which every way leaves out);
- ``kit torch``: the same chunks with the torch ops (``vocab_loss.torch_terms_and_grad``);
- ``liger fused linear``: ``LigerFusedLinearCrossEntropyLoss`` for the CE plus λ·T² ×
  ``LigerFusedLinearJSD(jsd_beta=0)`` for the KL (liger's β = 0 is the forward KL, teacher ‖ student, the one
  the kit computes; liger does not scale by T², so the weight carries it); each projects the student's logits
  itself;
- ``liger chunked``: ``chunked_loss.LigerFusedLinearJSDLoss(beta=0, weight_hard_loss=1, weight_soft_loss=λ·T²)``,
  CE and KL in one pass under ``torch.compile``. It masks both terms with one label tensor, so it can only
  express ``kl_tokens="assistant"`` (the KL over the positions with a target); it is compared on that case,
  beside the kit's fused way on the same inputs.

Two cases of positions: ``all`` (the kit's default, ``kl_tokens="all"``: the KL over every position, the CE on
the last 60%, as a prompt and its answer give) and ``assistant`` (CE and KL over every position passed). The
reference sits near the student (``xr = x + 0.025·noise``: a KL of about 1e-3, where HARI runs); at the first
length the exactness is also checked with an independent reference (a large KL, as the GPU test draws it).

Exactness is judged against a float32 computation of the same function: the logits as the bf16 lm_head gives
them, every term and the logits' gradient in float32 (``torch_terms_and_grad`` on upcast logits), the gradient's
GEMM in float32. The tolerances are ``tests/test_train_vocab_loss.py``'s, applied to the means: CE within
1e-4 + 1e-5·|CE|, KL within 1e-5 + 1e-4·|KL|, and the gradient within 2⁻⁸ of its largest element (one bf16
rounding). liger's JSD takes float32 logits from its GEMM; the KL of those unrounded logits is given too.

**The residual-add RMSNorm.** s = x + residual, y = RMSNorm(s), hidden 7168, bf16, eps 1e-6: transformers'
``DeepseekV3RMSNorm`` after a torch add (eager), the kit's ``add_rms_norm`` (a forward-only kernel: the prefix
layers run under no_grad) and liger's ``LigerFusedAddRMSNorm`` (llama casting, the DeepSeek module's
arithmetic). Forward under no_grad for all three; forward + backward to x and the residual (the weight frozen)
for eager and liger, the kit having no backward. Exactness against eager, as ``tests/test_prefix_layer.py``
measures it (the largest |a − b| / max(|b|, 1e-2); bf16 bound 3·2⁻⁷), and the share of elements equal bit
for bit.

Timing: CUDA events around each call, the ways alternating call by call after warm-up, the median; peak = the
most memory allocated during one call above what was allocated before it (its outputs included).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from dsr1kit.model.norm_kernels import add_rms_norm
from dsr1kit.train.vocab_loss import torch_terms_and_grad
from dsr1kit.train.vocab_loss_kernel import fused_terms_and_grad

GIB = 2**30
HIDDEN, VOCAB = 7168, 129_280
T, LAMBDA, CHUNK = 1.5, 0.9, 1024  # HARI's temperature and KL weight, the fast path's loss chunk
W_STD = 0.03  # lm_head init: logits of std ≈ 2.5 over the vocabulary
NEAR = 0.025  # the reference's hidden state = the student's + NEAR · noise: KL ≈ 1e-3
IGNORE = -100
DEVICE = "cuda"
CE_TOL, KL_TOL = (1e-4, 1e-5), (1e-5, 1e-4)  # (atol, rtol): the test's, per row there, on the means here
GRAD_TOL = 2 * 2**-8  # × max |grad|: the test's one bf16 rounding (2⁻⁸), once for the logits' gradient and
# once for the gradient's GEMM output
NORM_TOL = 3 * 2**-7


def liger():
    """liger-kernel's classes; a clear message where it is not installed."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        from liger_kernel.ops import LigerFusedAddRMSNormFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except ImportError as e:  # pragma: no cover - the bench's one extra package
        raise SystemExit(f"this bench needs liger-kernel (pip install liger-kernel): {e}") from e
    return (
        LigerFusedLinearJSDLoss,
        LigerFusedAddRMSNormFunction,
        LigerFusedLinearCrossEntropyLoss,
        LigerFusedLinearJSD,
    )


# -- timing ------------------------------------------------------------------------------------------


def time_ways(ways: dict, warmup: int, iters: int) -> dict[str, float]:
    """Median ms of each way's call, the ways alternating call by call (CUDA events)."""
    for _ in range(warmup):
        for fn in ways.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(iters):
        for name, fn in ways.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: round(statistics.median(ts), 3) for name, ts in times.items()}


def with_peak(fn):
    """(fn's result, GiB allocated at most during the call above what was allocated before it; None off CUDA)."""
    if DEVICE != "cuda":
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, round((torch.cuda.max_memory_allocated() - base) / GIB, 3)


# -- the vocabulary loss -------------------------------------------------------------------------------


def loss_inputs(tokens: int, weight: torch.Tensor, seed: int, near: bool) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device=DEVICE)
    noise = torch.randn(tokens, HIDDEN, generator=g, device=DEVICE)
    xr = x + NEAR * noise if near else noise
    targets = torch.randint(0, VOCAB, (tokens,), generator=g, device=DEVICE)
    return dict(x=x.to(torch.bfloat16), xr=xr.to(torch.bfloat16), W=weight, all_targets=targets)


def positions(inputs: dict, case: str) -> dict:
    """The case's targets and KL selection, and the kit's weights (w_ce = 1/n_ce, w_kl = λ·T²/n_kl)."""
    targets = inputs["all_targets"].clone()
    tokens = targets.shape[0]
    if case == "all":
        targets[: int(tokens * 0.4)] = IGNORE  # the prompt: no CE, KL still
    select = torch.ones(tokens, device=DEVICE)
    n_ce, n_kl = int((targets != IGNORE).sum()), int(select.sum())
    return dict(
        inputs,
        targets=targets,
        select=select,
        n_ce=n_ce,
        n_kl=n_kl,
        w_ce=1.0 / n_ce,
        w_kl=LAMBDA * T**2 / n_kl,
        kl_labels=None if bool(select.all()) else torch.where(select > 0, 0, IGNORE),
    )


def kit_way(terms):
    """The kit's chunk loop: both chunks' logits (bf16 GEMMs), ``terms`` for the CE/KL and the logits'
    gradient, that gradient's GEMM back to the hidden state (lm_head frozen)."""

    def run(p: dict):
        x, xr, w = p["x"], p["xr"], p["W"]
        ce_sum = kl_sum = torch.zeros((), device=DEVICE)
        grads = []
        for s in range(0, x.shape[0], CHUNK):
            e = s + CHUNK
            z, r = F.linear(x[s:e], w), F.linear(xr[s:e], w)
            ce, kl, g = terms(z, r, p["targets"][s:e], p["select"][s:e], T, p["w_ce"], p["w_kl"])
            del z, r
            grads.append(g @ w)
            ce_sum, kl_sum = ce_sum + ce.sum(), kl_sum + kl.sum()
        return ce_sum / p["n_ce"], kl_sum / p["n_kl"], torch.cat(grads)

    return run


def liger_fused_linear_way():
    _, _, flce_cls, fljsd_cls = liger()
    flce = flce_cls(ignore_index=IGNORE, reduction="mean")
    fljsd = fljsd_cls(jsd_beta=0.0, ignore_index=IGNORE, temperature=T)

    def run(p: dict):
        x = p["x"].detach().requires_grad_(True)
        ce = flce(p["W"], x, p["targets"])
        kl = fljsd(x, p["W"], p["xr"], p["W"], p["kl_labels"])
        (ce + LAMBDA * T**2 * kl).backward()
        return ce.detach(), kl.detach(), x.grad

    return run


def liger_chunked_way():
    jsd_cls = liger()[0]
    loss = jsd_cls(
        weight_hard_loss=1.0,
        weight_soft_loss=LAMBDA * T**2,
        beta=0.0,
        ignore_index=IGNORE,
        temperature=T,
        compiled=DEVICE == "cuda",  # torch.compile, as liger's default, where the timing is taken
        chunk_size=CHUNK,
        return_soft_hard_loss=True,
    )

    def run(p: dict):
        x = p["x"].detach().requires_grad_(True)
        total, soft, hard = loss(x, p["W"], p["xr"], p["W"], p["targets"])
        total.backward()
        return hard.detach(), soft.detach(), x.grad

    return run


W_BLOCK = 16384  # vocabulary rows of the lm_head upcast at a time for the reference's float32 GEMMs


def mm_fp32(a: torch.Tensor, w: torch.Tensor, transpose: bool) -> torch.Tensor:
    """a @ wᵀ (transpose) or a @ w in float32, the bf16 weight upcast a block of rows at a time (no float32 copy
    of the whole lm_head)."""
    a = a.float()
    if transpose:
        return torch.cat([a @ w[v : v + W_BLOCK].float().t() for v in range(0, w.shape[0], W_BLOCK)], 1)
    out = torch.zeros(a.shape[0], w.shape[1], device=a.device)
    for v in range(0, w.shape[0], W_BLOCK):
        out += a[:, v : v + W_BLOCK] @ w[v : v + W_BLOCK].float()
    return out


def reference(p: dict) -> dict:
    """The float32 computation of the same function (see the module's docstring), and the KL and CE of the
    logits left unrounded (a float32 GEMM output)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    x, xr, w = p["x"], p["xr"], p["W"]
    sums = torch.zeros(4, dtype=torch.float64, device=DEVICE)
    grad = torch.empty(x.shape, dtype=torch.float32, device=DEVICE)
    for s in range(0, x.shape[0], CHUNK):
        e = s + CHUNK
        tg, sel = p["targets"][s:e], p["select"][s:e]
        z, r = F.linear(x[s:e], w).float(), F.linear(xr[s:e], w).float()
        ce, kl, g = torch_terms_and_grad(z, r, tg, sel, T, p["w_ce"], p["w_kl"])
        del z, r
        grad[s:e] = mm_fp32(g, w, transpose=False)
        del g
        z32, r32 = mm_fp32(x[s:e], w, transpose=True), mm_fp32(xr[s:e], w, transpose=True)
        ce32, kl32, _ = torch_terms_and_grad(z32, r32, tg, sel, T, p["w_ce"], p["w_kl"])
        del z32, r32, _
        sums += torch.stack([ce.sum(), kl.sum(), ce32.sum(), kl32.sum()]).double()
    torch.backends.cuda.matmul.allow_tf32 = prev
    ce, kl, ce32, kl32 = sums.tolist()
    n_ce, n_kl = p["n_ce"], p["n_kl"]
    return dict(ce=ce / n_ce, kl=kl / n_kl, ce_fp32_logits=ce32 / n_ce, kl_fp32_logits=kl32 / n_kl, grad=grad)


def exactness(got, ref: dict) -> dict:
    ce, kl, grad = float(got[0]), float(got[1]), got[2]
    diff = grad.float() - ref["grad"]
    d_max, ref_max = float(diff.abs().max()), float(ref["grad"].abs().max())
    loss, loss_ref = ce + LAMBDA * T**2 * kl, ref["ce"] + LAMBDA * T**2 * ref["kl"]
    ok = (
        abs(ce - ref["ce"]) <= CE_TOL[0] + CE_TOL[1] * abs(ref["ce"])
        and abs(kl - ref["kl"]) <= KL_TOL[0] + KL_TOL[1] * abs(ref["kl"])
        and d_max <= GRAD_TOL * ref_max
    )
    return dict(
        ce=ce,
        kl=kl,
        ce_abs_diff=abs(ce - ref["ce"]),
        ce_rel_diff=abs(ce - ref["ce"]) / abs(ref["ce"]),
        kl_abs_diff=abs(kl - ref["kl"]),
        kl_rel_diff=abs(kl - ref["kl"]) / abs(ref["kl"]),
        kl_rel_diff_vs_fp32_logits=abs(kl - ref["kl_fp32_logits"]) / abs(ref["kl_fp32_logits"]),
        loss_rel_diff=abs(loss - loss_ref) / abs(loss_ref),
        grad_max_abs_diff=d_max,
        grad_max_abs_diff_over_max=d_max / ref_max,
        grad_rel_norm_diff=float(diff.norm() / ref["grad"].norm()),
        grad_has_nan=bool(torch.isnan(grad).any()),
        within_test_tolerance=bool(ok),
    )


LOSS_WAYS = {  # case -> the ways that compute its loss
    "all": ("kit fused", "kit torch", "liger fused linear"),
    "assistant": ("kit fused", "liger chunked"),
}


def loss_rows(tokens_list: list[int], warmup: int, iters: int, far_tokens: int | None) -> list[dict]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    weight = torch.cat(  # drawn a block at a time: no float32 copy of the whole lm_head
        [
            (torch.randn(min(W_BLOCK, VOCAB - v), HIDDEN, generator=g, device=DEVICE) * W_STD).to(
                torch.bfloat16
            )
            for v in range(0, VOCAB, W_BLOCK)
        ]
    )
    makers = {
        "kit fused": lambda: kit_way(fused_terms_and_grad),
        "kit torch": lambda: kit_way(torch_terms_and_grad),
        "liger fused linear": liger_fused_linear_way,
        "liger chunked": liger_chunked_way,
    }
    ways = {name: make() for name, make in makers.items()}
    rows = []
    # the default case first at every length, then the other, then the independent reference
    runs = [(case, n, "near") for case in LOSS_WAYS for n in tokens_list]
    runs += [(case, far_tokens, "far") for case in LOSS_WAYS] if far_tokens else []
    for case, tokens, regime in runs:
        inputs = loss_inputs(tokens, weight, seed=tokens + (regime == "far"), near=regime == "near")
        ways_here = {n: ways[n] for n in LOSS_WAYS[case]}
        rows += case_rows(positions(inputs, case), case, regime, ways_here, warmup, iters)
        del inputs
        torch.cuda.empty_cache()
    return rows


def case_rows(p: dict, case: str, regime: str, ways: dict, warmup: int, iters: int) -> list[dict]:
    """One case's rows: each way timed (near reference only) and checked against the float32 computation."""
    ref = reference(p)
    ms = (
        time_ways({name: (lambda f=f: f(p)) for name, f in ways.items()}, warmup, iters)
        if regime == "near" and DEVICE == "cuda"
        else {}
    )
    rows = []
    for name, way in ways.items():
        try:
            got, peak = with_peak(lambda way=way: way(p))
            row = dict(exactness(got, ref), peak_gib=peak)
            del got
        except Exception as e:  # a way that fails here is a row that says why
            row = dict(error=f"{type(e).__name__}: {e}"[:500])
        row = dict(
            kernel="vocab loss",
            tokens=p["x"].shape[0],
            case=case,
            reference=regime,
            way=name,
            ms=ms.get(name),
            **row,
            ref_ce=ref["ce"],
            ref_kl=ref["kl"],
            ref_kl_fp32_logits=ref["kl_fp32_logits"],
        )
        if ms:
            row["kit_fused_ms_over_this"] = round(ms["kit fused"] / ms[name], 3)
        rows.append(row)
        emit(row)
    return rows


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def print_loss_row(r: dict) -> None:
    head = f"vocab loss  {r['tokens']:>6}  {r['case']:<9} {r['reference']:<4} {r['way']:<19}"
    if "error" in r:
        print(head, "ERROR", r["error"], flush=True)
        return
    ms = "" if r["ms"] is None else f"{r['ms']:9.2f} ms  {r.get('kit_fused_ms_over_this', 0):5.3f}x"
    print(
        head,
        f"{ms:>22}  {fmt(r['peak_gib'], '6.2f')} GiB  CE rel {r['ce_rel_diff']:.1e}  KL rel {r['kl_rel_diff']:.1e}"
        f" (fp32 logits {r['kl_rel_diff_vs_fp32_logits']:.1e})  grad max/max {r['grad_max_abs_diff_over_max']:.1e}"
        f"  grad rel {r['grad_rel_norm_diff']:.1e}  {'exact' if r['within_test_tolerance'] else 'OUTSIDE'}",
        flush=True,
    )


# -- the residual-add RMSNorm --------------------------------------------------------------------------


def rms_norm_module():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    norm = DeepseekV3RMSNorm(HIDDEN, eps=1e-6).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=torch.Generator(device=DEVICE).manual_seed(3))
    norm.weight.requires_grad_(False)
    return norm


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """``tests/test_prefix_layer.py``'s measure: the largest |a − b| / max(|b|, 1e-2)."""
    return float(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max())


def norm_rows(tokens_list: list[int], warmup: int, iters: int) -> list[dict]:
    fn = liger()[1]
    norm = rms_norm_module()
    eps = float(norm.variance_epsilon)

    def eager(x, r):
        s = r + x
        return s, norm(s)

    def kit(x, r):
        return add_rms_norm(x, norm, r)

    def lig(x, r):
        y, s = fn.apply(x, r, norm.weight, eps, 0.0, "llama", False)
        return s, y

    rows = []
    for tokens in tokens_list:
        g = torch.Generator(device=DEVICE).manual_seed(tokens)
        x, r, gy, gs = (torch.randn(tokens, HIDDEN, generator=g, device=DEVICE) for _ in range(4))
        r = r * 4  # the residual stream runs larger than a layer's output
        x, r, gy, gs = (t.to(torch.bfloat16) for t in (x, r, gy, gs))
        rows += norm_forward_rows(x, r, {"eager": eager, "kit": kit, "liger": lig}, warmup, iters)
        rows += norm_backward_rows(x, r, gy, gs, {"eager": eager, "liger": lig}, warmup, iters)
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def norm_forward_rows(x, r, forward: dict, warmup: int, iters: int) -> list[dict]:
    ms = time_ways({k: (lambda f=f: f(x, r)) for k, f in forward.items()}, warmup, iters)
    rows, outs = [], {}
    for name, f in forward.items():
        outs[name], peak = with_peak(lambda f=f: f(x, r))
        (s, y), (es, ey) = outs[name], outs["eager"]
        row = dict(
            kernel="add rms norm",
            **{"pass": "forward"},
            tokens=x.shape[0],
            way=name,
            ms=ms[name],
            eager_ms_over_this=round(ms["eager"] / ms[name], 3),
            kit_ms_over_this=round(ms["kit"] / ms[name], 3),
            peak_gib=peak,
            sum_worst_rel=worst(s, es),
            norm_worst_rel=worst(y, ey),
            norm_max_abs_diff=float((y.float() - ey.float()).abs().max()),
            norm_bitwise_equal_share=float((y == ey).float().mean()),
            within_test_tolerance=worst(s, es) <= 2**-7 and worst(y, ey) <= NORM_TOL,
        )
        rows.append(row)
        emit(row)
    return rows


def norm_backward_rows(x, r, gy, gs, ways: dict, warmup: int, iters: int) -> list[dict]:
    """Forward + backward to x and the residual (the weight frozen); the gradients against eager's."""

    def backward(f):
        def run():
            xl, rl = x.detach().requires_grad_(True), r.detach().requires_grad_(True)
            s, y = f(xl, rl)
            torch.autograd.backward([y, s], [gy, gs])
            return y.detach(), xl.grad, rl.grad

        return run

    runs = {name: backward(f) for name, f in ways.items()}
    ms = time_ways(runs, warmup, iters)
    rows, got = [], {}
    for name, run in runs.items():
        got[name], peak = with_peak(run)
        (_, gx, gr), (_, ex, er) = got[name], got["eager"]
        row = dict(
            kernel="add rms norm",
            **{"pass": "forward+backward"},
            tokens=x.shape[0],
            way=name,
            ms=ms[name],
            eager_ms_over_this=round(ms["eager"] / ms[name], 3),
            peak_gib=peak,
            grad_x_worst_rel=worst(gx, ex),
            grad_x_rel_norm_diff=float((gx.float() - ex.float()).norm() / ex.float().norm()),
            grad_residual_worst_rel=worst(gr, er),
            grad_bitwise_equal_share=float((gx == ex).float().mean()),
        )
        rows.append(row)
        emit(row)
    return rows


def print_norm_row(r: dict) -> None:
    head = f"add rms norm {r['tokens']:>6}  {r['pass']:<16} {r['way']:<6} {r['ms']:8.3f} ms"
    head += f"  {r['eager_ms_over_this']:5.2f}x eager  {r['peak_gib']:5.2f} GiB"
    if r["pass"] == "forward":
        tail = (
            f"  vs eager: sum {r['sum_worst_rel']:.1e}  norm {r['norm_worst_rel']:.1e}"
            f"  bitwise {r['norm_bitwise_equal_share']:.4f}  {'exact' if r['within_test_tolerance'] else 'OUTSIDE'}"
        )
    else:
        tail = (
            f"  vs eager: grad x {r['grad_x_worst_rel']:.1e} (rel norm {r['grad_x_rel_norm_diff']:.1e})"
            f"  grad residual {r['grad_residual_worst_rel']:.1e}  bitwise {r['grad_bitwise_equal_share']:.4f}"
        )
    print(head + tail, flush=True)


SINK: dict = {}  # main's record and output path: each row is written as soon as it is measured


def emit(row: dict) -> None:
    """Print a row and write the record with it (a run cut short keeps what it measured)."""
    (print_loss_row if row["kernel"] == "vocab loss" else print_norm_row)(row)
    if SINK:
        SINK["record"]["rows"].append(row)
        SINK["out"].write_text(json.dumps(SINK["record"], indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384", help="sequence lengths, comma-separated")
    ap.add_argument(
        "--far-tokens",
        type=int,
        default=None,
        help="length of the independent-reference check (default: the first of --tokens; 0: none)",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="timed calls per way (the loss)")
    ap.add_argument("--norm-iters", type=int, default=50, help="timed calls per way (the norm)")
    ap.add_argument("--skip", default="", help="'loss' or 'norm' to leave one out")
    ap.add_argument("--device", default="cuda", help="cuda; cpu: the loss's exactness only, untimed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this bench times GPU kernels: no CUDA device here (--device cpu: exactness only)")
    if DEVICE != "cuda" and "norm" not in args.skip:
        raise SystemExit("off CUDA only the loss is checked: pass --skip norm")
    import liger_kernel
    import transformers
    import triton

    tokens = [int(t) for t in args.tokens.split(",") if t]
    far = tokens[0] if args.far_tokens is None else (args.far_tokens or None)
    record = dict(
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        liger_kernel=getattr(liger_kernel, "__version__", None) or _dist_version("liger-kernel"),
        settings=dict(
            hidden=HIDDEN,
            vocab=VOCAB,
            temperature=T,
            lambda_kl=LAMBDA,
            chunk=CHUNK,
            w_std=W_STD,
            near=NEAR,
            warmup=args.warmup,
            iters=args.iters,
            norm_iters=args.norm_iters,
        ),
        liger_jsd_impl=_liger_impl("jsd_loss_and_grad"),
        rows=[],
    )
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}), flush=True)
    SINK.update(record=record, out=Path(args.out))
    SINK["out"].write_text(json.dumps(record, indent=1) + "\n")
    if "norm" not in args.skip:  # the short part first
        norm_rows(tokens, args.warmup, args.norm_iters)
    if "loss" not in args.skip:
        loss_rows(tokens, args.warmup, args.iters, far)


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _liger_impl(op: str) -> str | None:
    """Which of liger's implementations its dispatcher picks for ``op`` on this GPU."""
    try:
        from liger_kernel.backends.dispatch import resolve_impl

        return resolve_impl(op, device=torch.device(DEVICE)).impl_name
    except Exception as e:  # an internal API: say so rather than fail the run
        return f"unknown ({type(e).__name__})"


if __name__ == "__main__":
    main()
