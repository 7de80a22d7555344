"""Degree-2 Maclaurin attention with the map fused into its two products, as Triton kernels,
bidirectional and (chunk by chunk, fused_causal.py) causal: GPUs, or the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them without a
GPU. docs/maths.md §14, fused products.

The degree-2 map's inner product is a polynomial of x'·y' (x' = x·d^-1/4):
φ(x)·φ(y) = a0 + a1 (x'·y') + a2 (x'·y')², so with ψ(x) = [1, x', x'⊗x'] (the full outer
product, d² entries, in place of the map's weighted upper triangle) the attention is

    S_j = Σ_l ψ_j(k_l) [v_l, 1]ᵀ                      (the state, j = 0, 1, 2)
    out_i = Σ_j a_j ψ_j(q_i)ᵀ S_j                      ([numerator, denominator] of query i)

The same function as the C++ kernel's (native_fused.py), with twice the degree-2 products and
nothing to unpack: every product is a ``tl.dot`` of a tile of ψ rows built in registers, the
rows never reach memory. Backward, as there:

    ∂S = Σ_i ψ(q_i) ∂out_iᵀ             (the state kernel on (q, ∂out))
    ∂[v, 1]_l = Σ_j a_j ψ_j(k_l)ᵀ ∂S_j  (the apply kernel on (k, ∂S))
    ∂x_i = J_ψ(x_i)ᵀ (a ⊙ S y_i)        (the pullback: ∂q from (q, S, ∂out), ∂k from
                                         (k, ∂S, [v, 1]))

Float32 products (``input_precision="ieee"``: no TF32), or with ``bf16`` the products'
inputs rounded to bfloat16 (ψ tiles, [v, 1] or ∂out, the state), accumulating in float32, as
the unfused bfloat16 GEMMs take them. Head sizes up to 64 (tiles padded to a power of two;
the tests compile every kernel for sm_80 and sm_90). The kernels (triton_kernels.py) are
imported on first use, so ``TRITON_INTERPRET`` is read then.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch
from torch.autograd.function import once_differentiable

from .fused_causal import chunked_causal_products

MAX_HEAD_DIM = 64


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs its kernels on the CPU with NumPy (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x: a CUDA tensor, or a CPU one under the interpreter."""
    return x.device.type == "cuda" or (x.device.type == "cpu" and interpreted())


@functools.cache
def _kernels():
    """(state, apply, pullback), imported on first use: TRITON_INTERPRET is read then, and a
    machine without triton imports this module all the same."""
    kernels = importlib.import_module(f"{__package__}.triton_kernels")

    return kernels.state_kernel, kernels.apply_kernel, kernels.pullback_kernel


def _blocks(d: int) -> tuple[int, int]:
    """(BD, BL): the head size padded to a power of two (at least 16, tl.dot's least), and the
    rows of a tile: 64 on a GPU, 128 under the interpreter (whose cost is per program and per
    operation, not per element)."""
    return max(16, 1 << (d - 1).bit_length()), 128 if interpreted() else 64


def _flags(bf16: bool) -> dict:
    """The kernels' precision flags: bfloat16 products, emulated exactly under the
    interpreter (its bfloat16 dot is wrong)."""
    return {"BF16": bf16, "EXACT_BF16": bf16 and interpreted()}


def _groups(x: torch.Tensor) -> tuple[int, int]:
    return x.numel() // max(1, x.shape[-2] * x.shape[-1]), x.shape[-2]


def _state(x, y, bf16):
    d = x.shape[-1]
    G, L = _groups(x)
    S = torch.empty(*x.shape[:-2], 1 + d + d * d, d + 1, device=x.device)
    BD, BL = _blocks(d)
    _kernels()[0][(G, d + 1)](x, y, S, L, d, d**-0.25, BD=BD, BL=BL, **_flags(bf16))
    return S


def _apply(x, S, coef, bf16):
    d = x.shape[-1]
    G, L = _groups(x)
    out = torch.empty(*x.shape[:-1], d + 1, device=x.device)
    BD, BL = _blocks(d)
    grid = (G, (L + BL - 1) // BL)
    _kernels()[1][grid](x, S, out, L, d, d**-0.25, *coef, BD=BD, BL=BL, **_flags(bf16))
    return out


def _pullback(x, S, y, coef, bf16):
    d = x.shape[-1]
    G, L = _groups(x)
    gx = torch.empty_like(x)
    BD, BL = _blocks(d)
    grid = (G, (L + BL - 1) // BL)
    _kernels()[2][grid](x, S, y, gx, L, d, d**-0.25, *coef[1:], BD=BD, BL=BL, **_flags(bf16))
    return gx


# ---- the two kernels' Functions, and the attention bidirectional and causal ----------------
def _weigh(S: torch.Tensor, coef) -> torch.Tensor:
    """S (..., 1 + d + d², e) with its blocks times (a0, a1, a2): the state's gradient through
    ``Σ_j a_j ψ_j(x)ᵀ S_j``."""
    d = S.shape[-1] - 1
    a = torch.cat(
        [S.new_full((1,), coef[0]), S.new_full((d,), coef[1]), S.new_full((d * d,), coef[2])]
    )
    return S * a[:, None]


class TritonState(torch.autograd.Function):
    """S = Σ_l ψ(x_l) y_lᵀ (unweighted) per group of x (..., L, d), y (..., L, d+1)."""

    @staticmethod
    def forward(ctx, x, y, bf16):
        x, y = x.contiguous(), y.contiguous()
        ctx.save_for_backward(x, y)
        ctx.bf16 = bf16
        return _state(x, y, bf16)

    @staticmethod
    @once_differentiable
    def backward(ctx, gS):
        x, y = ctx.saved_tensors
        gS, ones = gS.contiguous(), (1.0, 1.0, 1.0)
        gx = _pullback(x, gS, y, ones, ctx.bf16) if ctx.needs_input_grad[0] else None
        gy = _apply(x, gS, ones, ctx.bf16) if ctx.needs_input_grad[1] else None
        return gx, gy, None


class TritonApply(torch.autograd.Function):
    """out = Σ_j a_j ψ_j(x_l)ᵀ S_j per group of x (..., L, d), S (..., 1 + d + d², d+1)."""

    @staticmethod
    def forward(ctx, x, S, coef, bf16):
        x, S = x.contiguous(), S.contiguous()
        ctx.save_for_backward(x, S)
        ctx.coef, ctx.bf16 = coef, bf16
        return _apply(x, S, coef, bf16)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, S = ctx.saved_tensors
        g = g.contiguous()
        gx = _pullback(x, S, g, ctx.coef, ctx.bf16) if ctx.needs_input_grad[0] else None
        gS = _weigh(_state(x, g, ctx.bf16), ctx.coef) if ctx.needs_input_grad[1] else None
        return gx, gS, None, None


def triton_fused_products(q, k, v1, coef, bf16: bool = False) -> torch.Tensor:
    """[numerator, denominator] (..., N, d+1) of the bidirectional degree-2 Maclaurin
    attention with the Maclaurin coefficients ``coef`` = (a0, a1, a2), without feature rows
    in memory (float32 tensors on a CUDA device, or the CPU under the interpreter): the
    apply kernel over the state kernel's S, each Function's backward the kernels again."""
    coef = tuple(float(a) for a in coef)
    return TritonApply.apply(q, TritonState.apply(k, v1, bf16), coef, bf16)


def triton_causal_products(q, k, v1, coef, chunk: int, bf16: bool = False) -> torch.Tensor:
    """[numerator, denominator] (..., N, d+1) of the causal degree-2 Maclaurin attention, query
    i over keys j ≤ i, in chunks of ``chunk`` positions (fused_causal.py): the state kernel's
    ΔS of each chunk, summed over the chunks before and applied to the chunk's queries by
    the apply kernel; within a chunk the kernel itself. No feature rows in memory."""
    coef = tuple(float(a) for a in coef)
    return chunked_causal_products(
        q, k, v1, coef, chunk,
        state=lambda x, y: TritonState.apply(x, y, bf16),
        apply=lambda x, S: TritonApply.apply(x, S, coef, bf16),
    )  # fmt: skip
