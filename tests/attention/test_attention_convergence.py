"""RMFA and FAVOR+ converge to exact attention as D grows (NMSE ∝ 1/D for an unbiased
map); variance-reduced RMF measures beat the faithful one. Seeded; bounds are measured
values with a 4x margin (measured at D = 2048: 1.5e-3 to 2.4e-3)."""

from __future__ import annotations

import pytest
import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention.reference import kernelized_attention, nmse, uniform_attention

D_HEAD, HEADS = 16, 2


def _unit_inputs(N, M, seed, d=D_HEAD, B=2):
    """q, k rows of norm d^{1/4}: q·k/√d spread over [−1, 1], a non-trivial attention."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, HEADS, N, d, generator=g), torch.randn(B, HEADS, M, d, generator=g)
    v = torch.randn(B, HEADS, M, d, generator=g)
    return q / q.norm(dim=-1, keepdim=True) * d**0.25, k / k.norm(dim=-1, keepdim=True) * d**0.25, v


def _mean_nmse(name, D, N, M, causal, seeds=3, **options):
    errors = []
    for seed in range(seeds):
        q, k, v = _unit_inputs(N, M, seed)
        torch.manual_seed(100 + seed)
        attn = build_attention(name, head_dim=D_HEAD, num_heads=HEADS, num_features=D, **options)
        exact = kernelized_attention(q, k, v, "exp", None, causal)
        errors.append(float(nmse(attn(q, k, v, causal=causal), exact)))
    return sum(errors) / len(errors)


@pytest.mark.parametrize("name", ["rmfa", "favor"])
@pytest.mark.parametrize(
    "N,M,causal",
    [(48, 48, False), (48, 48, True), (32, 56, False)],
    ids=["bidirectional", "causal", "cross"],
)
def test_nmse_falls_with_num_features(name, N, M, causal):
    small, large = (_mean_nmse(name, D, N, M, causal) for D in (32, 2048))
    assert large < small / 16  # 1/D predicts 64
    assert large < 1e-2


def test_variance_reduced_measures_beat_faithful():
    """On pre-SBN'd inputs (unit rows, d = 64), each exact low degree removes variance: the exact
    constant (official) beats sampling it (faithful), and exact degree-0/1 terms (h01) cut the
    NMSE by orders of magnitude (docs/maths.md §13: 5.2e-4 faithful vs 9.3e-7 h01 at D = 128;
    measured here 5.4e-4 faithful, 2.7e-4 official, 1.1e-6 h01, the same order over three
    input seeds and three feature seeds)."""
    d, N = 64, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, N, d, generator=g) for _ in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    exact = kernelized_attention(q, k, v, "exp")
    errors = {}
    for measure in ("faithful", "official", "h01"):
        torch.manual_seed(0)
        attn = build_attention("rmfa", head_dim=d, num_heads=2, measure=measure)
        errors[measure] = float(nmse(attn(q, k, v), exact))
    assert errors["h01"] < errors["official"] < errors["faithful"]
    assert errors["h01"] < errors["faithful"] / 50
    assert errors["h01"] < float(nmse(uniform_attention(q, k, v), exact)) / 50
