"""The causal degree-2 Maclaurin attention from a fused kernel's two primitives, chunk by
chunk (docs/maths.md §14, fused products): the Triton kernels (triton_fused.py) and the C++
ones (native_fused.py) share it.

Query i attends to keys j ≤ i. Positions are cut into chunks of C; across chunks the state
primitive's ΔS_c = Σ_{l in c} φ(k_l) [v_l, 1]ᵀ, summed over the chunks before (the eager
path's exclusive prefix, ``before_each_chunk``), is applied to the chunk's queries by the
apply primitive; within a chunk the kernel itself, a0 + a1 s + a2 s² with s = q·k/√d,
masked to j ≤ i and multiplied by [v, 1] (C² entries a chunk, float32). No feature rows
reach memory; the chunks' states (D' by d+1 each, a state every C positions) are kept for
the backward, as the chunked eager path keeps its.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .products import before_each_chunk


def chunked_causal_products(
    q: torch.Tensor,
    k: torch.Tensor,
    v1: torch.Tensor,
    coef: tuple[float, float, float],
    chunk: int,
    state: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """[numerator, denominator] (..., N, d+1) for q, k (..., N, d), v1 = [v, 1] (..., N, d+1):
    ``state(x, y)`` is the differentiable Σ_l φ(x_l) y_lᵀ per group of x (..., L, d) and
    ``apply(x, S)`` the differentiable Sᵀ φ(x_l), with φ·φ = a0 + a1 s + a2 s² (``coef``)."""
    N, d = q.shape[-2], q.shape[-1]
    C = min(chunk, N)
    pad = -N % C
    if pad:
        q, k, v1 = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v1))
    nc = (N + pad) // C
    q, k, v1 = (t.reshape(*t.shape[:-2], nc, C, t.shape[-1]) for t in (q, k, v1))
    inter = apply(q, before_each_chunk(state(k, v1)))  # chunk states (..., nc, D', d + 1)
    s = (q @ k.transpose(-1, -2)) * d**-0.5
    tril = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    weights = (coef[0] + s * (coef[1] + coef[2] * s)).masked_fill(~tril, 0.0)
    out = inter + weights @ v1
    return out.reshape(*out.shape[:-3], nc * C, d + 1)[..., :N, :]
