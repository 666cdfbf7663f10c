"""The kit's Triton kernels compile for the GPUs they are meant for, without a GPU here.

Triton compiles to a cubin for a named target offline (its own ptxas), so a kernel that would fail to build on a
cluster's H100 is caught in ``make test``, and so is one whose FP8 GEMM no longer uses Hopper's wgmma (the slower
mma path would still run, only slower).
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsr1kit.model import fp8_kernels
from dsr1kit.train import vocab_loss_kernel

HOPPER = GPUTarget("cuda", 90, 32)
ADA = GPUTarget("cuda", 89, 32)


def _compile(fn, types: dict[str, str], constexprs: dict, target: GPUTarget, **options):
    signature = {name: types.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target, options=options
    )


GEMM_TYPES = {
    "A": "*fp8e4nv",
    "B": "*fp8e4nv",
    "AS": "*fp32",
    "BS": "*fp32",
    "C": "*bf16",
    "ROWS": "*i32",
    "BLOCK_EXPERT": "*i32",
    "ROUTE_W": "*fp32",
}


@pytest.mark.parametrize("grouped", [1, 2], ids=["grouped-gather", "grouped-scatter"])
@pytest.mark.parametrize("block_n", [128, 256], ids=["one-scale-per-step", "two-blocks-per-tile"])
def test_fp8_gemm_compiles_for_hopper_with_wgmma_and_for_ada(grouped, block_n):
    constexprs = {
        "GROUPED": grouped,
        "TOP_K": 8,
        "BLOCK_M": 64,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "GROUP_M": 8,
    }
    hopper = _compile(fp8_kernels._gemm, GEMM_TYPES, constexprs, HOPPER, num_warps=8, num_stages=3)
    assert "wgmma" in hopper.asm["ptx"] and hopper.asm["cubin"]
    assert _compile(fp8_kernels._gemm, GEMM_TYPES, constexprs, ADA, num_warps=4, num_stages=3).asm["cubin"]


def test_fp8_quantizers_compile_for_hopper():
    types = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32"}
    for fn in (fp8_kernels._quant, fp8_kernels._silu_mul_quant):
        assert _compile(fn, types, {"BLOCK_M": 16, "GROUP_K": 128}, HOPPER, num_warps=4).asm["cubin"]


@pytest.mark.parametrize("has_ref", [True, False])
def test_fused_vocab_loss_compiles_for_hopper(has_ref):
    types = {
        "Z": "*bf16",
        "R": "*bf16",
        "G": "*bf16",
        "TARGETS": "*i64",
        "KL_SELECT": "*fp32",
        "CE_OUT": "*fp32",
        "KL_OUT": "*fp32",
        "inv_t": "fp32",
        "w_ce": "fp32",
        "w_kl_over_t": "fp32",
    }
    constexprs = {"HAS_REF": has_ref, "BLOCK": vocab_loss_kernel.BLOCK_V}
    assert _compile(vocab_loss_kernel._ce_kl_grad, types, constexprs, HOPPER, num_warps=8).asm["cubin"]
