"""The CPU dropout of ``macformer_lit.models.dropout``: right drop rate in every lane of a
draw, unbiased, gradients through the same mask, seeded like torch's, identity when off."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from macformer_lit.models.dropout import Dropout, dropout, keep_mask
from macformer_lit.models.transformer import EncoderBlock


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_every_lane_of_a_draw_keeps_at_the_rate(p):
    torch.manual_seed(0)
    n = 4 * 200_000
    threshold = round(p * 65536)
    keep = keep_mask(torch.Size([n]), threshold, torch.device("cpu")).view(-1, 4)
    q = 1 - threshold / 65536
    sigma = math.sqrt(q * (1 - q) / keep.shape[0])
    # Each 16-bit lane of a 64-bit draw on its own (a draw missing its top bit fails lane 3).
    for lane, rate in enumerate(keep.float().mean(0).tolist()):
        assert abs(rate - q) < 5 * sigma, (lane, rate, q)
    # Neighbouring lanes independent: P(both kept) = q².
    both = (keep[:, 0] & keep[:, 1]).float().mean().item()
    assert abs(both - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / keep.shape[0])


def test_output_is_unbiased_and_the_gradient_uses_the_same_mask():
    torch.manual_seed(1)
    x = torch.randn(64, 300, 40, dtype=torch.float64, requires_grad=True)
    out = dropout(x, 0.25, True)
    kept = out != 0
    scale = 65536 / (65536 - round(0.25 * 65536))
    assert torch.equal(out[kept], x[kept] * scale)
    # E[out] = x: the mean of out / x over all entries is 1 within 5 sigma.
    ratio = (out / x).detach()
    sigma = math.sqrt(0.25 / 0.75 / x.numel())
    assert abs(ratio.mean().item() - 1.0) < 5 * sigma
    g = torch.randn_like(x)
    out.backward(g)
    assert torch.equal(x.grad, torch.where(kept, g * scale, torch.zeros_like(g)))


def test_seeded_like_torch_and_identity_when_off():
    x = torch.ones(8, 50, 16)
    torch.manual_seed(3)
    a = Dropout(0.1)(x)
    torch.manual_seed(3)
    b = Dropout(0.1)(x)
    torch.manual_seed(4)
    c = Dropout(0.1)(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    layer = Dropout(0.1).eval()
    assert layer(x) is x
    assert Dropout(0.0)(x) is x
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))
    # p that rounds to 1 in 2^-16 steps falls back to torch (no division by zero).
    assert torch.isfinite(Dropout(1 - 2**-18)(x)).all()


def test_models_use_it_and_checkpoints_are_unchanged():
    block = EncoderBlock(d_model=16, num_heads=2, ffn_dim=32, dropout=0.1)
    drops = [m for m in block.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(isinstance(m, Dropout) for m in drops)
    # A state dict holds no dropout entries: old checkpoints load as before.
    assert not any("dropout" in k for k in block.state_dict())


def test_torch_masks_on_request():
    from macformer_lit.models import dropout as module

    x = torch.randn(4, 30, 16)
    try:
        module.set_mask_generator("torch")
        torch.manual_seed(7)
        ours = Dropout(0.2)(x)
        torch.manual_seed(7)
        assert torch.equal(ours, torch.nn.functional.dropout(x, 0.2, True))
    finally:
        module.set_mask_generator("fast")
    torch.manual_seed(7)
    assert not torch.equal(Dropout(0.2)(x), ours)
    with pytest.raises(ValueError, match="valid: fast, torch"):
        module.set_mask_generator("philox")
