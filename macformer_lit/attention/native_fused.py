"""Degree-2 Maclaurin attention with the map fused into its two products, as a hand-written
CPU kernel (csrc/maclaurin2_fused.cpp; docs/maths.md §14, fused products): bidirectional,
and causal chunk by chunk on the same two primitives (fused_causal.py).

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
bfloat16 dot products (AVX512-BF16: two pairs a lane; on CPUs with AMX, Intel Sapphire
Rapids and later, as tile dot products of 16 × 32 by 32 × 16, zero-padded to whole tiles),
accumulating in float32; the state and the results stay float32. A CPU without the
instruction runs the float32 kernel instead (closer to exact than asked). Head sizes 16, 32,
48 and 64 (multiples of the 16-float vectors the loops are written in).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .fused_causal import chunked_causal_products
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


class NativeState(torch.autograd.Function):
    """S = Σ_l φ(x_l) y_lᵀ per group of x (..., L, d), y (..., L, e) float32 on the CPU,
    ``scale`` the map's (D',) float32 coefficients: (..., D', e) float32. Backward:
    ∂x = J_φ(x)ᵀ (∂S y) (the pullback), ∂y_l = ∂Sᵀ φ(x_l) (the apply primitive)."""

    @staticmethod
    def forward(ctx, x, y, scale, compiler, bf16):
        x, y = x.contiguous(), y.contiguous()
        ctx.save_for_backward(x, y, scale)
        ctx.compiler, ctx.bf16 = compiler, bf16
        return _state(library(compiler, "native_fused"), x, y, scale, bf16)

    @staticmethod
    @once_differentiable
    def backward(ctx, gS):
        x, y, scale = ctx.saved_tensors
        lib, bf16, gS = library(ctx.compiler, "native_fused"), ctx.bf16, gS.contiguous()
        gx = _pullback(lib, x, gS, y, scale, bf16) if ctx.needs_input_grad[0] else None
        gy = _apply(lib, x, gS, scale, bf16) if ctx.needs_input_grad[1] else None
        return gx, gy, None, None, None


class NativeApply(torch.autograd.Function):
    """out_l = Sᵀ φ(x_l) per group of x (..., L, d), S (..., D', e) float32 on the CPU:
    (..., L, e) float32. Backward: ∂x = J_φ(x)ᵀ (S ∂out) (the pullback), ∂S = Σ_l φ(x_l)
    ∂out_lᵀ (the state primitive)."""

    @staticmethod
    def forward(ctx, x, S, scale, compiler, bf16):
        x, S = x.contiguous(), S.contiguous()
        ctx.save_for_backward(x, S, scale)
        ctx.compiler, ctx.bf16 = compiler, bf16
        return _apply(library(compiler, "native_fused"), x, S, scale, bf16)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, S, scale = ctx.saved_tensors
        lib, bf16, g = library(ctx.compiler, "native_fused"), ctx.bf16, g.contiguous()
        gx = _pullback(lib, x, S, g, scale, bf16) if ctx.needs_input_grad[0] else None
        gS = _state(lib, x, g, scale, bf16) if ctx.needs_input_grad[1] else None
        return gx, gS, None, None, None


def native_fused_products(q, k, v1, scale, compiler: str, bf16: bool = False) -> torch.Tensor:
    """[numerator, denominator] (..., N, d+1) of the bidirectional degree-2 Maclaurin
    attention: φ(q)ᵀ[φ(k)ᵀ v1] without the feature rows in memory (float32 CPU tensors), the
    apply primitive over the state primitive's S. ``bf16``: the products' inputs rounded to
    bfloat16 where the CPU multiplies bfloat16 pairs (``bf16_dot()``), float32 otherwise."""
    scale = scale.float().contiguous()
    S = NativeState.apply(k, v1, scale, compiler, bf16)
    return NativeApply.apply(q, S, scale, compiler, bf16)


def native_causal_products(
    q, k, v1, scale, coef, chunk: int, compiler: str, bf16: bool = False
) -> torch.Tensor:
    """The causal attention's [numerator, denominator] (..., N, d+1), query i over keys j ≤ i,
    in chunks of ``chunk`` positions (fused_causal.py): each chunk's state by the state
    primitive, summed over the chunks before and applied by the apply primitive; within a
    chunk the kernel a0 + a1 s + a2 s² itself (``coef``, the map's inner product)."""
    scale, coef = scale.float().contiguous(), tuple(float(a) for a in coef)
    return chunked_causal_products(
        q, k, v1, coef, chunk,
        state=lambda x, y: NativeState.apply(x, y, scale, compiler, bf16),
        apply=lambda x, S: NativeApply.apply(x, S, scale, compiler, bf16),
    )  # fmt: skip


def bf16_dot(compiler: str) -> bool:
    """Whether this CPU's build has the bfloat16 dot products (AVX512-BF16)."""
    return bool(library(compiler, "native_fused").maclaurin2_bf16_dot())


def amx_tiles(compiler: str, want: bool | None = None) -> bool:
    """Whether the bfloat16 products run on AMX tiles (Intel Sapphire Rapids and later: a
    build for them, and the tiles granted by the OS); ``want`` turns them on or off first
    (off: the AVX512-BF16 loops run, for tests and comparisons)."""
    return bool(library(compiler, "native_fused").maclaurin2_amx(-1 if want is None else int(want)))
