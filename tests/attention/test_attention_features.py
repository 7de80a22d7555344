"""Random feature maps: unbiasedness (statistical, seeded), the fast map against the naive one,
the map run in batch pieces against one piece, the chunked causal product against explicit
prefix sums, orthogonal Gaussian draws."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import macformer_lit.attention.features as features
import macformer_lit.attention.pieces as pieces
from macformer_lit.attention import build_attention, get_kernel
from macformer_lit.attention.features import (
    MIN_DEGREE,
    MaclaurinMap,
    feature_seed,
    maclaurin_layout,
    sample_maclaurin,
    sample_orthogonal_gaussian,
)
from macformer_lit.attention.products import _chunk_prefix, causal_product
from macformer_lit.attention.reference import prefix_sum_product


def _unit_pair(d, dot, g):
    """x, y with ‖x‖ = ‖y‖ = 1 and x·y = dot."""
    a, b = torch.linalg.qr(torch.randn(d, 2, generator=g, dtype=torch.float64))[0].T
    return a, dot * a + math.sqrt(1 - dot**2) * b


def _rademacher_c(x, y):
    """c = E[⟨ω,x⟩²⟨ω,y⟩²] over Rademacher ω: the pairings of E[ω_i ω_j ω_k ω_l] give
    ‖x‖²‖y‖² + 2(x·y)², less 2 Σ x_i² y_i² for i = j = k = l counted three times."""
    return float((x @ x) * (y @ y) + 2 * (x @ y) ** 2 - 2 * ((x * y) ** 2).sum())


def _sampled_variance(kernel, x, y, *, p, m):
    """Var of one sampled term S = (a_N/π_N) Π_j ⟨ω_j,x⟩⟨ω_j,y⟩, N ~ π_n = (p−1)p^{−(n−m+1)},
    n ≥ m: E[S²] = Σ_{n≥m} a_n² cⁿ / π_n (the N factors are independent), minus the mean
    Σ_{n≥m} a_n (x·y)ⁿ squared. The series converges iff p·c < 1 (a_n ≤ 1 for these kernels)."""
    c, dot = _rademacher_c(x, y), float(x @ y)
    assert p * c < 0.5, (p, c)  # finite variance with margin: 0.5^400 ends the sum below
    second = sum(
        kernel.coefficient(n) ** 2 * c**n * p ** (n - m + 1) / (p - 1) for n in range(m, 400)
    )
    mean = sum(kernel.coefficient(n) * dot**n for n in range(m, 400))
    return second - mean**2


def test_rademacher_second_moment_by_enumeration():
    """The closed form of c against the mean over all 2^d sign vectors (d = 10)."""
    d, g = 10, torch.Generator().manual_seed(3)
    x, y = torch.randn(2, d, generator=g, dtype=torch.float64)
    bits = torch.arange(2**d).unsqueeze(1) >> torch.arange(d) & 1
    omega = (2 * bits - 1).double()
    exact = float(((omega @ x) ** 2 * (omega @ y) ** 2).mean())
    assert _rademacher_c(x, y) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("p", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("measure", list(MIN_DEGREE))
@pytest.mark.parametrize("name", ["exp", "inv", "log", "trigh", "sqrt"])
def test_maclaurin_map_is_unbiased(name, measure, p):
    """Φ(x)·Φ(y) is the exact low degrees plus the mean of D i.i.d. sampled terms, so it must sit
    within 5 standard deviations σ/√D of 𝒦(x·y), σ² from theory (`_sampled_variance`), not from
    the sample. Inputs are pre-SBN's, x = q/d^{1/4} with ‖q‖ = 1 (‖x‖² = d^{−1/2}, d = 16):
    there c ≤ 3/d and p·c < 1 for every p here, so σ is finite even for inv, log and sqrt,
    whose variance at ‖x‖ = 1 is infinite (a_n ≥ n^{−3/2}, c ≥ 1: Σ pⁿcⁿ a_n² diverges).
    p ≠ 2 is where the normalising (p−1) of the degree law matters. Seeded, so deterministic."""
    kernel, d, D, m = get_kernel(name), 16, 20_000, MIN_DEGREE[measure]
    g = torch.Generator().manual_seed(0)
    degrees, omega = sample_maclaurin(D, d, p=p, measure=measure, generator=g)
    lay = maclaurin_layout(kernel, degrees, omega, p=p, measure=measure)
    const = None if lay.const == 0 else torch.tensor(lay.const, dtype=torch.float64)
    for cos in (0.7, -0.4):
        x, y = (t / d**0.25 for t in _unit_pair(d, cos, g))
        phi = [MaclaurinMap.apply(t.view(1, 1, 1, d), lay.omega, const, lay.blocks) for t in (x, y)]
        estimate = float((phi[0] * phi[1]).sum())
        target = float(kernel.exact(x @ y))
        stderr = math.sqrt(_sampled_variance(kernel, x, y, p=p, m=m) / D)
        assert abs(estimate - target) < 5 * stderr, (cos, estimate, target, stderr)


def test_maclaurin_map_gradcheck():
    g = torch.Generator().manual_seed(1)
    degrees, omega = sample_maclaurin(40, 5, p=2.0, measure="faithful", generator=g)
    assert degrees.max() >= 3  # the seeded draw exercises products of 3+ factors
    lay = maclaurin_layout(get_kernel("exp"), degrees, omega, p=2.0, measure="faithful")
    x = (torch.randn(1, 1, 3, 5, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    const = torch.tensor(lay.const, dtype=torch.float64).view(1, 1, 1, 1)
    fn = lambda t: MaclaurinMap.apply(t, lay.omega, const, lay.blocks)  # noqa: E731
    assert torch.autograd.gradcheck(fn, x, fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("measure", ["faithful", "h01"])
def test_map_in_batch_pieces_equals_one_piece(monkeypatch, causal, measure):
    """The map runs over the batch in pieces of PIECE_BYTES (forward and backward): one
    batch entry a piece must give the same bits as the whole batch at once, for the output
    and every input gradient, with padding, in both the plain and the folded (causal) layout,
    through ppSBN (which computes its statistics over the whole batch before the map)."""
    torch.manual_seed(0)
    spec = {"name": "rmfa", "num_features": 48, "measure": measure, "pre_sbn": True}
    att = build_attention(spec, head_dim=8, num_heads=2)
    B, N = 5, 37
    q, k, v = (torch.randn(B, 2, N, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(B, N) > 0.2
    mask[:, 0] = True
    grad = torch.randn(B, 2, N, 8)
    runs = []
    for budget in (1 << 40, 1):
        monkeypatch.setattr(pieces, "PIECE_BYTES", budget)
        for t in (q, k, v):
            t.grad = None
        out = copy.deepcopy(att)(q, k, v, key_padding_mask=mask, causal=causal)
        out.backward(grad)
        runs.append([out.detach(), q.grad, k.grad, v.grad])
    parts = features._pieces(q.detach(), torch.zeros(B, 2, 3, 8), None, 4, 3)
    assert len(parts) == B  # the second run really ran entry by entry
    for whole, piecewise in zip(*runs):
        assert torch.equal(whole, piecewise)


def test_map_pieces_only_on_the_cpu(monkeypatch):
    """Off the CPU the map runs in one piece whatever PIECE_BYTES says (each piece costs
    a kernel launch per level on a GPU, and its allocator has no mmap page faults)."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1)
    x, w = torch.zeros(5, 2, 7, 8), torch.zeros(5, 2, 3, 8)
    assert len(features._pieces(x, w, None, 4, 3)) == 5
    meta = features._pieces(x.to("meta"), w.to("meta"), None, 4, 3)
    assert len(meta) == 1 and meta[0][0] == slice(None) and meta[0][1].device.type == "meta"


@pytest.mark.parametrize("nc,chunk", [(1, 1), (1, 7), (3, 4), (4, 5)])
def test_chunked_causal_equals_prefix_sums(nc, chunk):
    g = torch.Generator().manual_seed(nc * chunk)
    phi_q = torch.randn(2, 3, nc, 9, chunk, generator=g, dtype=torch.float64)  # (B,H,nc,D',C)
    phi_k = torch.randn(2, 3, nc, 9, chunk, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, nc, chunk, 5, generator=g, dtype=torch.float64)
    seq = lambda phi: phi.transpose(-1, -2).flatten(2, 3)  # noqa: E731  (B, H, N, D')
    expected = prefix_sum_product(seq(phi_q), seq(phi_k), v.flatten(2, 3))
    torch.testing.assert_close(causal_product(phi_q, phi_k, v).flatten(2, 3), expected)


def _eager_causal_product(phi_q, phi_k, v1):
    """The chunked product as the plain expression autograd differentiates (cumsum prefix)."""
    C = v1.shape[-2]
    low = v1.to(phi_k.dtype)
    keep = torch.ones(C, C, dtype=torch.bool).tril()
    scores = (phi_q.transpose(-1, -2) @ phi_k).masked_fill(~keep, 0.0)
    kv = (phi_k @ low).to(v1.dtype)
    state = torch.nn.functional.pad(kv.cumsum(-3)[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
    out = (scores @ low).to(v1.dtype)
    return out + (phi_q.transpose(-1, -2) @ state.to(phi_q.dtype)).to(v1.dtype)


@pytest.mark.parametrize(
    "rows,nc,chunk",
    [(torch.float64, 1, 5), (torch.float64, 4, 3), (torch.bfloat16, 3, 8)],
    ids=["float64-one-chunk", "float64", "bfloat16-rows"],
)
def test_chunked_causal_gradients_equal_autograds(rows, nc, chunk):
    """The written-out backward of ``causal_product`` gives autograd's gradients of the plain
    expression (a cumsum prefix): float64 to rounding. With bfloat16 rows and float32 values
    (the same casts) every output and gradient is within 8 bfloat16 roundings (u = 2⁻⁸ each:
    the casts of the upstream gradient and v, the rounded products and their sum) of
    Σ|terms|, the same expression in float64 over the inputs' absolute values, from the
    float64 result of the same inputs, as autograd's is."""
    g = torch.Generator().manual_seed(nc + chunk)
    values = torch.float64 if rows == torch.float64 else torch.float32
    phi_q0, phi_k0 = (
        torch.randn(2, 3, nc, 9, chunk, generator=g, dtype=torch.float64).to(rows) for _ in "qk"
    )
    v0 = torch.randn(2, 3, nc, chunk, 5, generator=g, dtype=values)
    weight = torch.randn(2, 3, nc, chunk, 5, generator=g, dtype=values)

    def run(fn, dtype=None, magnitude=False):
        inputs = [t.to(dtype).clone() for t in (phi_q0, phi_k0, v0)]
        if magnitude:
            inputs = [t.abs() for t in inputs]
        phi_q, phi_k, v = (t.requires_grad_() for t in inputs)
        out = fn(phi_q, phi_k, v)
        (out * (weight.abs().to(dtype) if magnitude else weight)).sum().backward()
        return out, phi_q.grad, phi_k.grad, v.grad

    ours, autograds = run(causal_product), run(_eager_causal_product)
    if rows == torch.float64:
        for a, b in zip(ours, autograds):
            torch.testing.assert_close(a, b)
        return
    exact = run(_eager_causal_product, torch.float64)
    scale = run(_eager_causal_product, torch.float64, magnitude=True)
    for name, a, b, e, m in zip(("out", "phi_q", "phi_k", "v"), ours, autograds, exact, scale):
        assert a.dtype == b.dtype
        bound = 8 * 2.0**-8 * m
        for path, t in (("ours", a), ("autograd", b)):
            excess = ((t.double() - e).abs() - bound).max().item()
            assert excess <= 0, (name, path, excess)


def test_chunk_prefix_sees_earlier_chunks_only():
    """The GEMM prefix over chunks: chunk c gets the sum of chunks < c, the reverse one of
    chunks > c, exactly (0/1 products), and a changed later chunk leaves earlier ones' bits."""
    g = torch.Generator().manual_seed(0)
    state = torch.randn(2, 3, 5, 4, 6, generator=g)
    before, after = _chunk_prefix(state, later=False), _chunk_prefix(state, later=True)
    for c in range(5):
        torch.testing.assert_close(before[:, :, c], state[:, :, :c].sum(2), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            after[:, :, c], state[:, :, c + 1 :].sum(2), rtol=1e-6, atol=1e-6
        )
    changed = state.clone()
    changed[:, :, 3:] = torch.randn(2, 3, 2, 4, 6, generator=g) * 100
    assert torch.equal(_chunk_prefix(changed, later=False)[:, :, :4], before[:, :, :4])


def test_orthogonal_gaussian_rows():
    g = torch.Generator().manual_seed(0)
    w = sample_orthogonal_gaussian(20, 8, row_norm="sqrt", generator=g).double()
    block = w[:8] @ w[:8].T
    torch.testing.assert_close(block, 8 * torch.eye(8, dtype=torch.float64), atol=1e-5, rtol=0)
    assert w.shape == (20, 8)
    chi = sample_orthogonal_gaussian(400, 8, row_norm="chi", generator=g).double()
    assert chi.norm(dim=1).pow(2).mean() == pytest.approx(8, rel=0.1)  # E[χ²_d] = d, SE 2.5 %


def test_feature_seed_is_deterministic_and_distinct():
    seeds = {feature_seed(0, layer, index) for layer in range(4) for index in range(50)}
    assert len(seeds) == 200 and feature_seed(1, 2, 3) == feature_seed(1, 2, 3)


def test_whole_batch_switch_runs_the_map_in_one_piece_on_the_cpu(monkeypatch):
    """``pieces.whole_batch()`` makes the CPU run every pass as a GPU does (one piece), and
    restores the pieces when it ends, also after an error."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1)
    x, w = torch.zeros(5, 2, 7, 8), torch.zeros(5, 2, 3, 8)
    with pieces.whole_batch():
        assert len(features._pieces(x, w, None, 4, 3)) == 1
        assert pieces.batch_slices(x) == [slice(None)]
    assert len(features._pieces(x, w, None, 4, 3)) == 5
    with pytest.raises(RuntimeError), pieces.whole_batch():
        raise RuntimeError("inside")
    assert len(pieces.batch_slices(x)) == 5
