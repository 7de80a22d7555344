"""The deterministic degree-2 Maclaurin backend: exact for its own kernel (checked against
the kernel's truncated series, independently of the map), positive denominators, and the
batch pieces changing nothing."""

from __future__ import annotations

import pytest
import torch

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
