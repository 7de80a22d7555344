"""What the native-kernel tests share (test_native_map.py, test_native_fused.py, and the Triton
kernels' triton_interpreted.py): the C++ compiler they build with (the files skip without
one), float32's unit roundoff, the degree-2 map's coefficients, the eager float64 products
the fused kernels are measured against, and the sizes of what autograd keeps."""

from __future__ import annotations

import shutil

import pytest
import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention.maclaurin import maclaurin_rows

U32 = 2.0**-24
CXX = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def scale(d: int):
    """The degree-2 map's (D',) coefficients at head size d."""
    return build_attention("maclaurin", head_dim=d, num_heads=1)._scale


def _eager_products(q, k, v1, scale):
    """φ(q)ᵀ[φ(k)ᵀ v1] from the eager map (the weighted upper triangle), in q's dtype."""
    phi_q = maclaurin_rows(q, scale.to(q.dtype), 2, q.dtype)
    phi_k = maclaurin_rows(k, scale.to(q.dtype), 2, q.dtype)
    return phi_q @ (phi_k.transpose(-1, -2) @ v1)


def saved_sizes(fn) -> list[int]:
    """Bytes of each tensor autograd keeps for the backward of fn()."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def assert_within_float32_rounding(
    products, q, k, v1, g, scale, steps, device="cpu", bf16_roundings=0
):
    """``products(q, k, v1)`` (a fused kernel) and its three gradients against ∂out = g: every
    entry within γ_steps·Σ|terms| of the eager float64 one, Σ|terms| the same expression at
    |q|, |k|, |v1|, |g| (every term is a product with non-negative scales), and not exact (a
    float32 result, so the bound is not met vacuously). ``bf16_roundings`` r > 0: the kernel
    rounds r factors of every term to bfloat16 (unit roundoff 2⁻⁸), so the bound is
    ((1 + 2⁻⁸)^r (1 + γ_steps) − 1)·Σ|terms|. Returns the largest err / Σ|terms| of each
    result (out, ∂q, ∂k, ∂v1)."""
    leaves = [t.to(device).requires_grad_() for t in (q, k, v1)]
    fused = products(*leaves)
    fused_grads = torch.autograd.grad(fused, leaves, g.to(device))
    exact64 = [t.double().requires_grad_() for t in (q, k, v1)]
    exact = _eager_products(*exact64, scale.double())
    exact_grads = torch.autograd.grad(exact, exact64, g.double())
    size64 = [t.double().abs().requires_grad_() for t in (q, k, v1)]
    size = _eager_products(*size64, scale.double())
    size_grads = torch.autograd.grad(size, size64, g.double().abs())
    gamma = steps * U32 / (1 - steps * U32)
    bound = (1 + 2.0**-8) ** bf16_roundings * (1 + gamma) - 1
    worst = []
    for name, a, b, s in zip(
        ["out", "∂q", "∂k", "∂v1"],
        [fused, *fused_grads],
        [exact, *exact_grads],
        [size, *size_grads],
    ):
        err = (a.detach().cpu().double() - b).abs()
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert (err <= bound * s).all(), (name, float((err / (bound * s)).max()))
        assert err.max() > 0, name
        worst.append(float((err / s).detach().max()))
    return worst


def spied(monkeypatch, module, names) -> list[str]:
    """Calls of ``module``'s functions ``names``, recorded in order (so a match with the
    unfused path is not the unfused path itself)."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls
