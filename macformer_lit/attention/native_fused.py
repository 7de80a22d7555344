"""Bidirectional degree-2 Maclaurin attention with the map fused into its two products, as a
hand-written CPU kernel (csrc/maclaurin2_fused.cpp; docs/maths.md §14, fused products).

    S = Σ_l φ(k_l) [v_l, 1]ᵀ            (D' × (d+1), per batch entry and head)
    out_i = Sᵀ φ(q_i)                   ([numerator, denominator] of query i)

The unfused path writes every feature row to memory (D' = 561 floats a position at d = 32,
in bfloat16 with ``feature_dtype: bfloat16``), multiplies them in two GEMMs, and reads them
back for the backward. Here the rows are built a tile of 32 positions at a time in a buffer
that stays in cache, multiplied there in float32 with the products' register blocks, and
built again in the backward: only q, k, [v, 1] and the small state S are kept. Backward:

    ∂S = Σ_i φ(q_i) ∂out_iᵀ             (the state primitive on (q, ∂out))
    ∂[v, 1]_l = ∂Sᵀ φ(k_l)              (the apply primitive on (k, ∂S))
    ∂q_i = J_φ(q_i)ᵀ (S ∂out_i),  ∂k_l = J_φ(k_l)ᵀ (∂S [v, 1]_l)   (the pullback)

In float32 (``feature_dtype: float32``) the rows are the eager float32 map's bit for bit and
the sums run in another order than the GEMMs': the error is float32 rounding. With
``feature_dtype: bfloat16`` the products' inputs (the rows, [v, 1] or ∂out, the state) are
rounded to bfloat16 as the unfused bfloat16 GEMMs take them, and multiplied with the CPU's
bfloat16 dot products (AVX512-BF16: two pairs a lane), accumulating in float32; the state
and the results stay float32. A CPU without the instruction runs the float32 kernel instead
(closer to exact than asked). Head sizes 16, 32, 48 and 64 (multiples of the 16-float
vectors the loops are written in).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .native_map import library

HEAD_DIMS = (16, 32, 48, 64)


def _groups(x: torch.Tensor) -> tuple[int, int]:
    """(G, L) of x (..., L, last): the leading dims flattened into groups."""
    return x.numel() // max(1, x.shape[-2] * x.shape[-1]), x.shape[-2]


def _call(fn, *tensors, G: int, L: int, d: int, bf16: bool) -> None:
    code = fn(*(t.data_ptr() for t in tensors), G, L, d, int(bf16), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"native_fused: true takes head_dim in {HEAD_DIMS}; got {d}")


def _state(lib, x, y, scale, bf16):
    """S (..., D', e) = Σ_l φ(x_l) y_lᵀ over x (..., L, d), y (..., L, e)."""
    d = x.shape[-1]
    D = 1 + d + d * (d + 1) // 2
    S = torch.empty(*x.shape[:-2], D, d + 1)
    G, L = _groups(x)
    _call(lib.maclaurin2_state, x, y, scale, S, G=G, L=L, d=d, bf16=bf16)
    return S


def _apply(lib, x, S, scale, bf16):
    """out (..., L, e) = Sᵀ φ(x_l) for x (..., L, d)."""
    d = x.shape[-1]
    out = torch.empty(*x.shape[:-1], d + 1)
    G, L = _groups(x)
    _call(lib.maclaurin2_apply, x, S, scale, out, G=G, L=L, d=d, bf16=bf16)
    return out


def _pullback(lib, x, S, y, scale, bf16):
    """∂x (..., L, d) = J_φ(x_l)ᵀ (S y_l)."""
    gx = torch.empty_like(x)
    G, L = _groups(x)
    _call(lib.maclaurin2_pullback, x, S, y, scale, gx, G=G, L=L, d=x.shape[-1], bf16=bf16)
    return gx


class NativeFusedProducts(torch.autograd.Function):
    """φ(q)ᵀ[φ(k)ᵀ v1] for q (..., N, d), k (..., M, d), v1 (..., M, d+1), all float32 on
    the CPU, ``scale`` the map's (D',) float32 coefficients: (..., N, d+1) float32. The
    gradient reaches q, k and v1 (the scale is a constant buffer)."""

    @staticmethod
    def forward(ctx, q, k, v1, scale, compiler, bf16):
        lib = library(compiler, "native_fused")
        q, k, v1 = q.contiguous(), k.contiguous(), v1.contiguous()
        S = _state(lib, k, v1, scale, bf16)
        out = _apply(lib, q, S, scale, bf16)
        ctx.save_for_backward(q, k, v1, S, scale)
        ctx.compiler, ctx.bf16 = compiler, bf16
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v1, S, scale = ctx.saved_tensors
        lib, bf16 = library(ctx.compiler, "native_fused"), ctx.bf16
        g = g.contiguous()
        need_q, need_k, need_v1 = ctx.needs_input_grad[:3]
        gq = _pullback(lib, q, S, g, scale, bf16) if need_q else None
        gk = gv1 = None
        if need_k or need_v1:
            gS = _state(lib, q, g, scale, bf16)
            gv1 = _apply(lib, k, gS, scale, bf16) if need_v1 else None
            gk = _pullback(lib, k, gS, v1, scale, bf16) if need_k else None
        return gq, gk, gv1, None, None, None


def native_fused_products(q, k, v1, scale, compiler: str, bf16: bool = False) -> torch.Tensor:
    """[numerator, denominator] (..., N, d+1) of the bidirectional degree-2 Maclaurin
    attention: φ(q)ᵀ[φ(k)ᵀ v1] without the feature rows in memory (float32 CPU tensors).
    ``bf16``: the products' inputs rounded to bfloat16 where the CPU multiplies bfloat16
    pairs (``bf16_dot()``), float32 otherwise."""
    return NativeFusedProducts.apply(q, k, v1, scale.float().contiguous(), compiler, bf16)


def bf16_dot(compiler: str) -> bool:
    """Whether this CPU's build has the bfloat16 dot products (AVX512-BF16)."""
    return bool(library(compiler, "native_fused").maclaurin2_bf16_dot())
