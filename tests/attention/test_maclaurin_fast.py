"""The Maclaurin backend's fast options (docs/maths.md §14, fast options): bfloat16 rows
within the bound of their five roundings, gradients within the same count of roundings
norm-wise (the fused products' bfloat16 inputs too), the compiled map equal to the eager
one, and compile_map refused where no C++ compiler is."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention.native_fused import bf16_dot
from macformer_lit.attention.reference import keep_mask

U = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, round to nearest
U32 = 2.0**-24


def _inputs(seed, B=2, H=2, N=300, d=32, tau=16.0):
    """q rows of norm tau and k rows of norm 1, as pre-SBN with a temperature leaves them."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in "qkv")
    q = torch.nn.functional.normalize(q, dim=-1) * tau
    k = torch.nn.functional.normalize(k, dim=-1)
    mask = torch.ones(B, N, dtype=torch.bool)
    if B > 1:
        mask[1, N - 70 :] = False
    return q, k, v, mask


def rounding_bound(attn, q, k, v, mask, causal):
    """Per-entry bound on |bfloat16 path - exact| (docs/maths.md §14, fast options). Five
    roundings to bfloat16 (φ(q), φ(k), v1, the state φ(k)ᵀv1, the product φ(q)ᵀ·state), float32
    accumulation over M keys (γ_M) twice, the map and the division in float32: each
    numerator entry is off by at most c·Σ_j K_abs(q_i, k_j)|v_jc| and the denominator by
    c·Σ_j K_abs(q_i, k_j), where K_abs = a0 + a1·t + a2·t², t = Σ_a|q_a k_a|/√d bounds
    Σ_f |φ_f(q) φ_f(k)| (it is that sum). Rows whose denominator the bound does not keep
    positive (large τ, few keys) get no bound (inf)."""
    d, M = q.shape[-1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    t = q.abs() @ k.abs().transpose(-1, -2) / math.sqrt(d)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    keep = keep_mask(q, k, mask, causal).double()
    k_abs = attn.kernel.truncated(t, 2) * keep
    kernel = attn.kernel.truncated(s, 2) * keep
    den = kernel.sum(-1, keepdim=True)
    exact = (kernel @ v) / den
    gamma = M * U32 / (1 - M * U32)
    c = (1 + U) ** 5 * (1 + U32) ** 6 - 1 + 2 * gamma
    e_num, e_den = c * (k_abs @ v.abs()), c * k_abs.sum(-1, keepdim=True)
    bound = (e_num + exact.abs() * e_den) / (den - e_den) + U32 * exact.abs()
    return exact, torch.where(den > e_den, bound, torch.inf)


CXX = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
# The fused products (native_fused) with bfloat16 inputs, bidirectional and causal (chunk by
# chunk); they round where the CPU has bfloat16 dot products, and are float32 (closer than the
# bound asks) where it has not.
PATHS = [
    pytest.param({}, id="unfused"),
    pytest.param(
        {"native_fused": True},
        id="fused",
        marks=pytest.mark.skipif(CXX is None, reason="no C++ compiler"),
    ),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("tau", [1.0, 16.0, 128.0])
@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_rows_within_their_rounding_bound(causal, tau, path):
    q, k, v, mask = _inputs(0, tau=tau)
    attn = build_attention("maclaurin", head_dim=32, num_heads=2, feature_dtype="bfloat16", **path)
    exact, bound = rounding_bound(attn, q, k, v, mask, causal)
    out = attn(q, k, v, key_padding_mask=mask, causal=causal).double()
    err = (out - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert bound.isfinite().float().mean() > (0.9 if tau > 16 else 0.999)
    if path and not bf16_dot(CXX):
        return  # float32 products: nothing rounded to tell apart
    # Not vacuous: the rows are rounded (float32 rows are ~1e4 times closer).
    assert (
        err.max()
        > 100
        * (
            build_attention("maclaurin", head_dim=32, num_heads=2)(
                q, k, v, key_padding_mask=mask, causal=causal
            ).double()
            - exact
        )
        .abs()
        .max()
    )


def test_decoding_with_bfloat16_rows_within_the_bound():
    """``step`` keeps its running state in float32: each row within the causal bound."""
    q, k, v, _ = _inputs(1, B=1, N=40)
    attn = build_attention("maclaurin", head_dim=32, num_heads=2, feature_dtype="bfloat16")
    exact, bound = rounding_bound(attn, q, k, v, None, True)
    state, rows = None, []
    for i in range(q.shape[2]):
        out, state = attn.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], state)
        rows.append(out)
    assert state["kv"].dtype == torch.float32
    err = (torch.cat(rows, 2).double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("tau", [1.0, 128.0])
@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_gradients_within_five_roundings(tau, path):
    """Norm-wise relative error of dq, dk, dv against float64 at most 5u (the forward's
    count of roundings; measured about 1u, docs/maths.md §14, fast options)."""
    q0, k0, v0, mask = _inputs(2, tau=tau)
    w = torch.randn(v0.shape, generator=torch.Generator().manual_seed(3))
    grads = {}
    for dtype in ("float32", "bfloat16"):
        options = path if dtype == "bfloat16" else {}
        attn = build_attention(
            "maclaurin", head_dim=32, num_heads=2, feature_dtype=dtype, **options
        )
        cast = torch.float64 if dtype == "float32" else torch.float32
        q, k, v = (t.to(cast).requires_grad_() for t in (q0, k0, v0))
        (attn.to(cast)(q, k, v, key_padding_mask=mask).double() * w).sum().backward()
        grads[dtype] = [t.grad.double() for t in (q, k, v)]
    for low, exact in zip(grads["bfloat16"], grads["float32"]):
        rel = float((low - exact).norm() / exact.norm())
        assert 0 < rel <= 5 * U, rel


def test_float64_models_keep_float64_rows():
    attn = build_attention("maclaurin", head_dim=8, num_heads=2, feature_dtype="bfloat16")
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    assert attn._map(x).dtype == torch.float64
    assert attn._map(x.float()).dtype == torch.bfloat16


def test_compiled_map_equals_the_eager_map():
    """Forward and backward, in ppSBN, at two lengths from one graph (dynamic shapes)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0)
    eager = build_attention(spec, head_dim=16, num_heads=2)
    fused = build_attention({**spec, "compile_map": True}, head_dim=16, num_heads=2)
    fused.load_state_dict(eager.state_dict())
    for n in (37, 90):
        q0, k0, v0, mask = _inputs(4, N=n, d=16, tau=1.0)
        results = []
        for attn in (eager, fused):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            out = attn(q, k, v, key_padding_mask=mask)
            (out * mask[:, None, :, None]).square().sum().backward()
            results.append((out, q.grad, k.grad, v.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_map_needs_a_cxx_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="compile_map: true needs a C\\+\\+ compiler"):
        build_attention("maclaurin", head_dim=8, num_heads=2, compile_map=True)


def test_unknown_feature_dtype():
    with pytest.raises(ValueError, match="feature_dtype"):
        build_attention("maclaurin", head_dim=8, num_heads=2, feature_dtype="float16")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_bfloat16_rows_and_compiled_map_on_the_gpu(causal):
    """cuBLAS's bf16 GEMMs and the Triton map inside the same bound as on the CPU."""
    q, k, v, mask = _inputs(5, tau=16.0)
    attn = build_attention(
        "maclaurin", head_dim=32, num_heads=2, feature_dtype="bfloat16", compile_map=True
    )
    exact, bound = rounding_bound(attn, q, k, v, mask, causal)
    out = attn.cuda()(*(t.cuda() for t in (q, k, v)), key_padding_mask=mask.cuda(), causal=causal)
    err = (out.double().cpu() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
