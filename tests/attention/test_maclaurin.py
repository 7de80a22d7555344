"""The deterministic degree-2 Maclaurin backend: exact for its own kernel (checked against
the kernel's truncated series, independently of the map), positive denominators, and the
batch pieces changing nothing."""

from __future__ import annotations

import pytest
import torch
from native_support import CXX

from macformer_lit.attention import build_attention, pieces
from macformer_lit.attention.kernels import get_kernel
from macformer_lit.attention.reference import keep_mask, kernelized_attention, weighted_average


@pytest.mark.parametrize("kernel", ["exp", "inv"])
@pytest.mark.parametrize("degree", [1, 2])
def test_exact_for_the_truncated_kernel(kernel, degree):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float64) for _ in "qkv")
    attn = build_attention(
        "maclaurin", head_dim=8, num_heads=2, kernel=kernel, degree=degree, bounded_inputs=True
    ).double()
    s = q @ k.transpose(-1, -2) / 8**0.5
    weights = get_kernel(kernel, bounded_inputs=True).truncated(s, degree)
    keep = keep_mask(q, k, None, False)
    if degree == 2:
        assert weights.min() > 0  # 1 + s + s²/2 ≥ 1/2
        torch.testing.assert_close(attn(q, k, v), weighted_average(weights, v, keep))
    phi_q, phi_k = attn.reference_features(q, k, None)
    torch.testing.assert_close(phi_q @ phi_k.transpose(-1, -2), weights)
    assert phi_q.shape[-1] == (1 + 8 + 36 if degree == 2 else 1 + 8)


def test_close_to_exp_attention_for_small_logits():
    """The cut series differs from exp by O(s³): at |s| ≤ 0.1 the outputs agree to ~1e-4."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 16, dtype=torch.float64) for _ in "qkv")
    q, k = (x / x.norm(dim=-1, keepdim=True) * 0.8 for x in (q, k))
    attn = build_attention("maclaurin", head_dim=16, num_heads=2).double()
    err = (attn(q, k, v) - kernelized_attention(q, k, v, "exp")).abs().max()
    assert err < 1e-3


def test_batch_pieces_change_nothing():
    """Large enough for several pieces (float64, N = 700: two entries a piece)."""
    torch.manual_seed(0)
    attn = build_attention("maclaurin", head_dim=32, num_heads=2).double()
    q, k, v = (torch.randn(8, 2, 700, 32, dtype=torch.float64) for _ in "qkv")
    mask = torch.ones(8, 700, dtype=torch.bool)
    mask[3, 500:] = False
    results = []
    for whole in (False, True):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        if whole:
            with pieces.whole_batch():
                out = attn(q_, k_, v_, key_padding_mask=mask)
        else:
            out = attn(q_, k_, v_, key_padding_mask=mask)
        (out * mask[:, None, :, None]).sum().backward()
        results.append((out.detach(), q_.grad, k_.grad, v_.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bad_degree():
    with pytest.raises(ValueError, match="degree must be 1 or 2"):
        build_attention("maclaurin", head_dim=8, num_heads=2, degree=3)


def _relu_case(seed=0, dtype=torch.float64, B=2, N=13, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, N, d, generator=g, dtype=dtype) for _ in "qkv")
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N - 4 :] = False
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True])
def test_relu_inputs_weight_keys_by_the_positive_parts(causal):
    """``input_map: relu``: the weights are 1 + s + s²/2 of s = q⁺·k⁺/√d (never below the
    weight of an orthogonal key, so an anti-aligned key no longer gets an aligned one's
    weight), forward and reference alike; q's and k's negative entries get no gradient."""
    q, k, v, mask = _relu_case()
    s = q.relu() @ k.relu().transpose(-1, -2) / 8**0.5
    assert (q @ k.transpose(-1, -2)).min() < -1.0  # signed inputs would reach the far side
    attn, out, gq, gk = _weighted_by(s, "relu", causal)
    assert gq[q < 0].abs().max() == 0 and gk[k < 0].abs().max() == 0
    assert gq[q > 0].abs().max() > 0
    signed = build_attention("maclaurin", head_dim=8, num_heads=2).double()
    assert (signed(q, k, v, key_padding_mask=mask, causal=causal) - out).abs().max() > 1e-2


def _weighted_by(s, input_map, causal):
    """The ``input_map`` backend on ``_relu_case()``: its output and its reference are the
    average of v weighted by 1 + s + s²/2 over the visible keys; returns the backend, the
    output and ∂q, ∂k of the real rows' sum."""
    q, k, v, mask = _relu_case()
    attn = build_attention("maclaurin", head_dim=8, num_heads=2, input_map=input_map).double()
    expected = weighted_average(1 + s + s**2 / 2, v, keep_mask(q, k, mask, causal))
    q_, k_ = q.clone().requires_grad_(), k.clone().requires_grad_()
    out = attn(q_, k_, v, key_padding_mask=mask, causal=causal)
    real = mask[:, None, :, None]
    torch.testing.assert_close(out * real, expected * real)
    reference = attn.reference(q, k, v, key_padding_mask=mask, causal=causal)
    torch.testing.assert_close(reference * real, expected * real)
    (out * real).sum().backward()
    return attn, out.detach(), q_.grad, k_.grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "options",
    [{}, {"native_map": True}, {"native_fused": True},
     {"native_fused": True, "feature_dtype": "bfloat16"}],
    ids=["eager", "native_map", "native_fused", "native_fused_bf16"],
)  # fmt: skip
def test_relu_inputs_are_mapped_once_on_every_path(options, causal):
    """Every kernel path takes q⁺ and k⁺: the relu backend's output and gradients are the
    same path's signed backend's on relu(q), relu(k) (the same bits), so no path skips the
    map (mapping twice would change nothing: max(·, 0) is idempotent)."""
    _assert_mapped_once("relu", 32, 32, torch.relu, options, causal)


def _assert_mapped_once(input_map, d, signed_d, mapping, options, causal):
    """The ``input_map`` backend's output and gradients are the same path's signed backend's
    (head size ``signed_d``) on mapping(q), mapping(k), bit for bit."""
    if options and CXX is None:
        pytest.skip("no C++ compiler")
    q, k, v, mask = _relu_case(seed=1, dtype=torch.float32, N=37, d=d)
    mapped = build_attention("maclaurin", head_dim=d, num_heads=2, input_map=input_map, **options)
    signed = build_attention("maclaurin", head_dim=signed_d, num_heads=2, **options)
    real = mask[:, None, :, None]
    results = []
    for attn, map_first in ((mapped, False), (signed, True)):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        qi, ki = (mapping(q_), mapping(k_)) if map_first else (q_, k_)
        out = attn(qi, ki, v_, key_padding_mask=mask, causal=causal)
        (out * real).sum().backward()
        results.append((out * real, q_.grad, k_.grad, v_.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("input_map", ["relu", "sign_split"])
def test_mapped_inputs_in_decoding_steps(input_map):
    """``step`` maps q and k too: each step's output is the causal pass's row."""
    q, k, v, _ = _relu_case(seed=2, N=6)
    attn = build_attention("maclaurin", head_dim=8, num_heads=2, input_map=input_map).double()
    full = attn(q, k, v, causal=True)
    state = None
    for t in range(6):
        out, state = attn.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        torch.testing.assert_close(out, full[:, :, t : t + 1])


def test_unknown_input_map_is_refused():
    with pytest.raises(
        ValueError, match="input_map must be one of identity, relu, sign_split; got 'abs'"
    ):
        build_attention("maclaurin", head_dim=8, num_heads=2, input_map="abs")


def _split(x):
    return torch.cat([x.relu(), (-x).relu()], -1)


@pytest.mark.parametrize("causal", [False, True])
def test_sign_split_inputs_weight_keys_by_agreeing_signs(causal):
    """``input_map: sign_split``: the weights are 1 + s + s²/2 of s = (q⁺·k⁺ + q⁻·k⁻)/√d, the
    sum over the entries where q and k agree in sign (≥ 0, so an anti-aligned key gets an
    orthogonal one's weight, not an aligned one's), forward and reference alike, from
    1 + 2d + d(2d + 1) features; every entry of q and k gets a gradient."""
    q, k, v, mask = _relu_case()
    s = q.relu() @ k.relu().transpose(-1, -2) + (-q).relu() @ (-k).relu().transpose(-1, -2)
    s = s / 8**0.5
    torch.testing.assert_close(s, _split(q) @ _split(k).transpose(-1, -2) / 8**0.5)
    assert s.min() >= 0 and (q @ k.transpose(-1, -2)).min() < -1.0
    attn, out, gq, gk = _weighted_by(s, "sign_split", causal)
    assert attn.num_features == 1 + 16 + 8 * 17
    # relu's map passes negative entries no gradient; the split passes every one that meets
    # a query negative there (all of them bidirectionally; a late causal key meets few).
    real = mask[:, None, :, None]
    if not causal:
        assert gq[(q < 0) & real].ne(0).all() and gk[(k < 0) & real].ne(0).all()
    relu = build_attention("maclaurin", head_dim=8, num_heads=2, input_map="relu").double()
    assert (relu(q, k, v, key_padding_mask=mask, causal=causal) - out).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "options",
    [{}, {"native_map": True}, {"native_map": True, "feature_dtype": "bfloat16"},
     {"compile_map": True}],
    ids=["eager", "native_map", "native_map_bf16", "compile_map"],
)  # fmt: skip
def test_sign_split_inputs_are_mapped_once_on_every_path(options, causal):
    """Every path the split takes gives the same bits as that path's signed backend of twice
    the head size on [q⁺, q⁻]·2^{1/4}, [k⁺, k⁻]·2^{1/4}: the map sees the split inputs once."""
    _assert_mapped_once("sign_split", 16, 32, lambda x: _split(x) * 2**0.25, options, causal)


@pytest.mark.parametrize("option", ["native_fused", "triton_fused"])
def test_sign_split_refuses_the_fused_kernels(option):
    """The fused kernels take values as wide as the keys; the split keys are twice as wide."""
    with pytest.raises(ValueError, match=f"^{option}: true fuses values as wide as the keys"):
        build_attention(
            "maclaurin", head_dim=16, num_heads=2, input_map="sign_split", **{option: True}
        )
