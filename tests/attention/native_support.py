"""What the native-kernel tests share (test_native_map.py, test_native_fused.py,
test_native_sbn.py, and the Triton kernels' triton_interpreted.py and
triton_sbn_interpreted.py): the C++ compiler they build with (the files skip without one),
float32's unit roundoff, the degree-2 map's coefficients, the eager float64 products the
fused kernels are measured against, post-SBN's power over float32's whole range, one
training call of a ppSBN attention, and the sizes of what autograd keeps."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention.eager_sbn import PostSBN
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


def assert_post_sbn_power_within_bound(post_sbn, shape, gen, device="cpu"):
    """``post_sbn(out, γ, log β)`` (a native or Triton post-SBN) over |y| = |γ·out| from 1e-35
    to 1e35 and β from 0.5 to 2, against the eager float64 power: with log and exp each
    within 2 ulp the relative error is at most u·(6 + 5|t| + β|l|), l = log|y|, t = (β − 1)·l
    (the roundings of y, of t and of the product, the functions' 2 ulp of l and of exp(t),
    and β's own rounding times l); results beyond float32's range are ±inf and below its
    normal range at most its smallest normal, as the eager power's. ``shape`` (B, H, L, d)."""
    tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    H, d = shape[1], shape[3]
    exponent = torch.empty(shape).uniform_(-80, 80, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    out = (sign * exponent.exp()).float()
    gamma = torch.rand(H, 1, d, generator=gen) + 0.5
    log_beta = torch.rand(H, 1, d, generator=gen) * 1.4 - 0.7
    found = post_sbn(*(t.to(device) for t in (out, gamma, log_beta))).double().cpu()
    exact = PostSBN.apply(out.double(), gamma.double(), log_beta.double())
    y = gamma.double() * out.double()
    beta = log_beta.double().exp()
    log_abs = y.abs().log()
    t = ((beta - 1) * log_abs).abs()
    normal = (exact.abs() >= tiny) & (exact.abs() <= huge)
    bound = U32 * (6 + 5 * t + beta * log_abs.abs()) * exact.abs()
    assert ((found - exact).abs() <= bound)[normal].all()
    assert normal.float().mean() > 0.5  # most of the range is tested
    over, under = exact.abs() > huge, exact.abs() < tiny
    assert over.any() and under.any()
    assert torch.equal(found[over], exact[over].sign() * float("inf"))
    assert (found[under].abs() <= tiny).all()


def ppsbn_step_results(attn, q, k, v, mask, grad, dtype, device="cpu") -> list[torch.Tensor]:
    """A copy of ppSBN attention ``attn`` in ``dtype`` on ``device`` after one training call:
    its output, the gradients of q, k, v, γ, log β and τ's parameter, the running estimates
    after the step, and the evaluation output after it."""
    attn = copy.deepcopy(attn).to(device, dtype).train()
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, key_padding_mask=mask)
    out.backward(grad.to(dtype))
    params = (attn.gamma, attn.log_beta, attn.temperature_logit)
    with torch.no_grad():
        evaluated = attn.eval()(q, k, v, key_padding_mask=mask)
    found = [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in params)]
    return found + [attn.running_mean, attn.running_var, evaluated]


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
