"""The attention contract (docs/maths.md §1) for every registered backend, bare and in ppSBN."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from macformer_lit.attention import AttentionBackend
from macformer_lit.attention.reference import reference_forward


def _pad_mask(B, N, lengths):
    return torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("causal,M", [(False, 11), (True, 11), (False, 6)])
def test_shapes_and_finite(build, make_inputs, causal, M):
    attn = build()
    assert isinstance(attn, AttentionBackend)
    q, k, v = make_inputs(N=11, M=M)
    out = attn(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("causal,M", [(False, 11), (True, 11), (False, 6)])
def test_outputs_and_gradients_match_reference(build, make_inputs, causal, M, training):
    attn = build().train(training)
    q, k, v = make_inputs(N=11, M=M)
    mask = _pad_mask(2, M, [M, M - 3])
    query_mask = mask if M == 11 else None
    grads = []
    reference = functools.partial(reference_forward, attn)
    for fn in (reference, attn):  # the reference first: the module moves running stats
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(q_, k_, v_, key_padding_mask=mask, causal=causal, query_padding_mask=query_mask)
        if query_mask is not None:
            out = out * query_mask[:, None, :, None]
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        grads.append((out.detach(), q_.grad, k_.grad, v_.grad))
    for expected, actual, what in zip(grads[0], grads[1], ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-9, msg=what)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_change_nothing(build, make_inputs, causal, training):
    """Self-attention: appending padded positions (junk q, k, v) leaves real outputs alone."""
    attn = build().train(training)
    q, k, v = make_inputs(N=9)
    junk = make_inputs(N=4, seed=1, scale=3.0)
    mask = _pad_mask(2, 13, [9, 7])
    out_short = copy.deepcopy(attn)(
        q, k, v, key_padding_mask=mask[:, :9], causal=causal, query_padding_mask=mask[:, :9]
    )
    q2, k2, v2 = (torch.cat([a, b], dim=2) for a, b in zip((q, k, v), junk))
    out_long = copy.deepcopy(attn)(
        q2, k2, v2, key_padding_mask=mask, causal=causal, query_padding_mask=mask
    )
    real = mask[:, None, :9, None].expand_as(out_short)
    torch.testing.assert_close(out_long[:, :, :9][real], out_short[real], rtol=1e-9, atol=1e-10)


def test_padded_keys_change_nothing_cross(build, make_inputs):
    attn = build()
    q, k, v = make_inputs(N=5, M=7)
    _, k_junk, v_junk = make_inputs(N=5, M=3, seed=1, scale=3.0)
    mask = _pad_mask(2, 10, [7, 5])
    out_short = copy.deepcopy(attn)(q, k, v, key_padding_mask=mask[:, :7])
    k2, v2 = torch.cat([k, k_junk], 2), torch.cat([v, v_junk], 2)
    out_long = copy.deepcopy(attn)(q, k2, v2, key_padding_mask=mask)
    torch.testing.assert_close(out_long, out_short, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("training", [False, True])
def test_causal_no_leak(build, make_inputs, training):
    """Changing positions > t (q, k and v) leaves outputs ≤ t unchanged, in training too."""
    attn = build().train(training)
    q, k, v = make_inputs(N=11)
    t = 6
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, t + 1 :] = torch.randn_like(x[:, :, t + 1 :]) * 3
    out = copy.deepcopy(attn)(q, k, v, causal=True)
    out2 = copy.deepcopy(attn)(q2, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], rtol=1e-9, atol=1e-10)


def test_step_matches_full_causal_pass(build, make_inputs):
    attn = build().eval()
    q, k, v = make_inputs(N=11)
    full = attn(q, k, v, causal=True)
    state, outs = None, []
    for t in range(q.shape[2]):
        out, state = attn.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-9, atol=1e-10)


def test_state_dict_round_trip(build, make_inputs):
    """Features (and all other state) come back from a checkpoint, whatever the new draw."""
    a, b = build(seed=0).eval(), build(seed=1).eval()
    state = a.state_dict()
    b.load_state_dict(copy.deepcopy(state))
    for key, value in b.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    q, k, v = make_inputs()
    torch.testing.assert_close(b(q, k, v), a(q, k, v), rtol=0, atol=0)
    torch.testing.assert_close(b(q, k, v, causal=True), a(q, k, v, causal=True), rtol=0, atol=0)


def _assert_near(actual, expected, tol, what):
    """max |actual − expected| ≤ tol · max |expected| (a relative error scaled by the largest
    entry: entries near 0 carry the rounding of the large ones). An expected zero tensor (the
    gradient of an input a backend ignores, as uniform's q and k) must be matched exactly."""
    if not expected.abs().max() > 0:
        assert not actual.abs().max() > 0, f"{what}: nonzero where float64 is zero"
        return
    err = float((actual.double() - expected).abs().max() / expected.abs().max())
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


# Unit roundoff per dtype. Under autocast every backend, bare and in ppSBN, measured at most
# 1.8 u against its float64 copy (outputs and q, k, v gradients); the bound is 4 u.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_low_precision_matches_float64(build, make_inputs, dtype):
    """The same module and the same (low-precision) inputs, run in float64, are the reference:
    what is left is the rounding of the low-precision computation."""
    attn = build(dtype=torch.float32).train()
    reference = copy.deepcopy(attn).double()  # before the pass moves running statistics
    q, k, v = (x.to(dtype).requires_grad_() for x in make_inputs(N=11, dtype=torch.float32))
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    tol = 4 * UNIT_ROUNDOFF[dtype]
    for causal in (False, True):
        with torch.autocast("cpu", dtype=dtype):
            out = attn(q, k, v, causal=causal)
        expected = reference(qr, kr, vr, causal=causal)
        assert out.dtype == dtype
        _assert_near(out, expected.detach(), tol, f"out causal={causal}")
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(expected)
        (out.float() * weights.float()).sum().backward()
        (expected * weights).sum().backward()
    for x, xr, what in zip((q, k, v), (qr, kr, vr), ("dq", "dk", "dv")):
        _assert_near(x.grad, xr.grad, tol, what)


@pytest.mark.parametrize("norm", [1e-4, 1e2, 1e4])
def test_large_and_small_norms_match_float64(build, make_inputs, norm, backend_case):
    """float32 against the same module in float64 at extreme row norms. A relative error u in
    q or k moves a score s = q·k/√d by |s|·u, so a bare backend's output may be off by about
    max|s|·u; pre-SBN standardises q and k first (measured at most 7 u over all backends and
    norms). Bound: 16 u, times max(1, max|s|) for bare backends (measured at most 45 u, at
    max|s| = 3.5e3). Bare FAVOR+ at norms ≥ 1e2 is compared for finiteness only: its features
    exp(ω·x − ‖x‖²/2) then span more than float32's exponent range, so float32 flushes to 0
    features that float64 keeps (relative error ≈ 1); bounding the norm is pre-SBN's job."""
    name, sbn = backend_case
    attn = build(dtype=torch.float32).train()
    reference = copy.deepcopy(attn).double()
    q, k, v = make_inputs(N=11, dtype=torch.float32)
    q, k = (x / x.norm(dim=-1, keepdim=True) * norm for x in (q, k))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    qr, kr, vr = (x.detach().double() for x in (q, k, v))
    mask = _pad_mask(2, 11, [11, 8])
    s_max = float((qr @ kr.transpose(-1, -2)).abs().max()) / q.shape[-1] ** 0.5
    tol = 16 * UNIT_ROUNDOFF[torch.float32] * (1.0 if sbn else max(1.0, s_max))
    compare = sbn or name != "favor" or norm < 1e2
    for causal in (False, True):
        out = attn(q, k, v, key_padding_mask=mask, causal=causal, query_padding_mask=mask)
        assert torch.isfinite(out).all(), causal
        if compare:
            expected = reference(
                qr, kr, vr, key_padding_mask=mask, causal=causal, query_padding_mask=mask
            )
            real = mask[:, None, :, None]
            _assert_near(out.detach() * real, expected * real, tol, f"out causal={causal}")
        out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
