"""The Triton fused Maclaurin products' numbers (attention/triton_fused.py),
run by test_triton_fused.py in a process of their own: on a machine without a GPU under
Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before triton.language is
imported: its standard functions are built then). Within float32's rounding of the float64
products and of their exact gradients, with bfloat16 inputs within the fast options' bound,
no feature rows kept for the backward, the attention equal to the unfused float32 one
(bidirectional and causal; float64 untouched)."""

from __future__ import annotations

import pytest
import torch
from native_support import assert_within_float32_rounding, saved_sizes, spied

from macformer_lit.attention import build_attention
from macformer_lit.attention import maclaurin as maclaurin_module
from macformer_lit.attention.triton_fused import runs_on, triton_fused_products

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not runs_on(torch.empty(0, device=DEVICE)):
    pytest.exit("run by test_triton_fused.py: TRITON_INTERPRET=1 without a GPU", returncode=4)


def _attention(d, **options):
    return build_attention(dict(name="maclaurin", **options), head_dim=d, num_heads=1)


# 16: one tile of head size; 48: padded to 64 (masked columns); N = 37 and M = 150: a part
# tile, and two tiles with the last a part (128 rows a tile under the interpreter).
@pytest.mark.parametrize("d", [16, 48])
def test_products_and_gradients_within_float32_rounding(d):
    """The kernels sum the full outer product x'⊗x' (d² terms, each off-diagonal pair once
    each way) where the map has the weighted triangle: the same function, and Σ|terms| is the
    same (|w·x_a x_b y_a y_b| = 2|x_a x_b y_a y_b|). Every entry of the products and the three
    gradients is a sum of float32 roundings of float64 terms: ψ entries (2 roundings), the
    state's sum over M keys, the apply's over 1 + d + d² terms, the pullback's over d + 1
    columns and 2d terms, and a few products with the coefficients: within γ_K·Σ|terms| with
    K = max(N, M) + 1 + d + d² + 3(d + 1) + 16 on the longest path."""
    gen = torch.Generator().manual_seed(d)
    N, M = 37, 150
    q, k = torch.randn(1, 2, N, d, generator=gen), torch.randn(1, 2, M, d, generator=gen)
    v1, g = torch.randn(1, 2, M, d + 1, generator=gen), torch.randn(1, 2, N, d + 1, generator=gen)
    attn = _attention(d)
    assert_within_float32_rounding(
        lambda *leaves: triton_fused_products(*leaves, attn._coefficients),
        q, k, v1, g, attn._scale, steps=max(N, M) + 1 + d + d * d + 3 * (d + 1) + 16,
        device=DEVICE,
    )  # fmt: skip


def test_no_feature_rows_kept_for_the_backward():
    """No tensor the attention keeps is as large as one side's feature rows (N·D' floats a
    head, D' = 153 at d = 16), and all it keeps together are less than the rows of q and k."""
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0)
    unfused = build_attention(spec, head_dim=16, num_heads=2).to(DEVICE)
    fused = build_attention({**spec, "triton_fused": True}, head_dim=16, num_heads=2)
    fused = fused.to(DEVICE)
    q, k, v = (torch.randn(1, 2, 256, 16, device=DEVICE, requires_grad=True) for _ in "qkv")
    one_side = 1 * 2 * 256 * 153 * 4
    kept_unfused = saved_sizes(lambda: unfused(q, k, v))
    kept_fused = saved_sizes(lambda: fused(q, k, v))
    assert sum(kept_unfused) > 2 * one_side
    assert max(kept_fused) < one_side and sum(kept_fused) < 2 * one_side, kept_fused


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_attention_equals_the_unfused_float32_one(causal, monkeypatch):
    """In ppSBN with padding, N = 90 (causal: a chunk of 64 and a part), the Triton kernels
    agree with the float32 GEMMs to float32 rounding, forward and the three gradients (causal:
    the chunks' states through the state and apply kernels, the chunk itself through its
    kernel values)."""
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0)
    unfused = build_attention(spec, head_dim=16, num_heads=2).to(DEVICE)
    fused = build_attention({**spec, "triton_fused": True}, head_dim=16, num_heads=2)
    fused = fused.to(DEVICE)
    fused.load_state_dict(unfused.state_dict())
    g = torch.Generator().manual_seed(3)
    q0, k0, v0 = (torch.randn(2, 2, 90, 16, generator=g).to(DEVICE) for _ in "qkv")
    mask = torch.ones(2, 90, dtype=torch.bool, device=DEVICE)
    mask[1, 60:] = False
    results = []
    calls = spied(
        monkeypatch, maclaurin_module, ["triton_fused_products", "triton_causal_products"]
    )
    for attn in (unfused, fused):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attn(q, k, v, key_padding_mask=mask, causal=causal)
        (out * mask[:, None, :, None]).square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    assert calls == ["triton_causal_products" if causal else "triton_fused_products"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_bfloat16_inputs_within_the_fast_options_bound(causal):
    """With ``feature_dtype: bfloat16`` the products' inputs are rounded as the unfused
    bfloat16 GEMMs round them (at most the same five roundings): within the fast options'
    per-entry bound (test_maclaurin_fast.py), and not float32 (the rows are rounded)."""
    from test_maclaurin_fast import _inputs, rounding_bound

    q, k, v, mask = (t.to(DEVICE) for t in _inputs(0, B=2, H=1, N=150, tau=16.0))
    spec = dict(feature_dtype="bfloat16", triton_fused=True)
    attn = build_attention(dict(name="maclaurin", **spec), head_dim=32, num_heads=1)
    exact, bound = rounding_bound(attn, q.cpu(), k.cpu(), v.cpu(), mask.cpu(), causal)
    out = attn.to(DEVICE)(q, k, v, key_padding_mask=mask, causal=causal).cpu().double()
    err = (out - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert bound.isfinite().float().mean() > 0.999
    float32 = build_attention("maclaurin", head_dim=32, num_heads=1).to(DEVICE)
    err32 = float32(q, k, v, key_padding_mask=mask, causal=causal).cpu().double() - exact
    err32 = err32.abs()
    assert err.max() > 100 * err32.max()


def test_float64_takes_the_unfused_products():
    attn = _attention(16, triton_fused=True).double().to(DEVICE)
    ref = _attention(16).double().to(DEVICE)
    q, k, v = (torch.randn(1, 1, 20, 16, dtype=torch.float64, device=DEVICE) for _ in "qkv")
    assert torch.equal(attn(q, k, v), ref(q, k, v))
