"""ppSBN's Triton passes' numbers (``triton_sbn: true``, attention/triton_sbn.py), run by
test_triton_sbn.py in a process of their own: on a machine without a GPU under Triton's
interpreter (``TRITON_INTERPRET=1``, which must be set before triton.language is imported).
Pre-SBN's and post-SBN's Functions, forward and backward, no further from float64 than the
eager float32 functions (padding, a fully padded sequence, the temperature and its
gradient, shared γ); post-SBN's power within its rounding bound; bfloat16 input read
exactly and its gradient rounded as a cast; transposed views read and written in place; the
same bits on every call; the whole ppSBN attention with ``triton_sbn`` against the eager
one; float64 left to the eager functions."""

from __future__ import annotations

import pytest
import torch
from native_support import U32, assert_post_sbn_power_within_bound, ppsbn_step_results

from macformer_lit.attention import build_attention
from macformer_lit.attention import ppsbn as ppsbn_module
from macformer_lit.attention.eager_sbn import BatchStandardiseNormalise, PostSBN
from macformer_lit.attention.triton_sbn import TritonPostSBN, TritonStandardiseNormalise, runs_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not runs_on(torch.empty(0, device=DEVICE)):
    pytest.exit("run by test_triton_sbn.py: TRITON_INTERPRET=1 without a GPU", returncode=4)

# L = 37: under the interpreter three tiles of 16 rows (the last a part) in two summing
# chunks of 32; on a GPU one part tile. D = 20: padded to 32 columns.
B, H, L, D = 3, 2, 37, 20


def _identity(t):
    return t


def _mask(kind: str) -> torch.Tensor | None:
    """None (every position real), or padding: a part of one sequence and all of another."""
    if kind == "full":
        return None
    mask = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    mask[1, 20:] = False
    mask[2, :] = False
    return mask


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE)


def _pre(fn, x, mask, tau, g):
    """(out, μ, σ², ∂x, ∂τ) of pre-SBN on x (float32, or float64 for the exact values): the
    Triton Function (``fn`` = "triton"), or the eager one times τ."""
    x = x.detach().clone().requires_grad_()
    dtype = torch.promote_types(x.dtype, torch.float32)
    tau = None if tau is None else tau.detach().to(dtype).requires_grad_()
    n = torch.tensor(float(B * L) if mask is None else float(mask.sum()), dtype=dtype)
    n, eps = n.to(DEVICE), torch.full((), 1e-13, dtype=dtype, device=DEVICE)
    if fn == "triton":
        w = None if mask is None else mask.to(dtype).contiguous()
        y, mean, var = TritonStandardiseNormalise.apply(x, w, n, eps, tau, _identity)
    else:
        w = None if mask is None else mask[:, None, :, None].to(dtype)
        y, mean, var = BatchStandardiseNormalise.apply(x, w, n, eps)
        y = y if tau is None else y * tau
    y.backward(g.to(y.dtype))
    return [y.detach(), mean, var, x.grad] + ([] if tau is None else [tau.grad])


def _post(fn, out, gamma, log_beta, g):
    """(result, ∂out, ∂γ, ∂log β) of post-SBN ``fn`` on copies of the leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (out, gamma, log_beta)]
    result = fn.apply(*leaves)
    result.backward(g.to(result.dtype))
    return [result.detach()] + [t.grad for t in leaves]


def _assert_as_close_as_eager(names, found, eager, exact):
    """Each of ``found`` (Triton, float32) within max(4 × the eager float32 error, 32 float32
    roundings) of ``exact`` (the eager functions in float64), both errors relative to the
    largest exact value. Why this bound: both compute the same maths in float32, so the eager
    error measures what float32 costs on these inputs; the kernels round no more often (tiles
    of 16 rows summed in float32, the tiles and chunks in float64 where eager sums every row
    in float32; divisions and square roots IEEE-rounded), in another order: 4× leaves room
    for that order (measured under the interpreter: 0.4–2.3×, every result within 15
    roundings). The floor, 32 roundings, is where eager lands closer than its own rounding
    count: y = z/‖z‖ alone takes the moments' (~2), the standardisation's (~3), the norm's
    sum of D = 20 squares (≤ 10 relative) and the division's; the gradients a few more."""
    for name, f, e, x in zip(names, found, eager, exact):
        assert f.dtype == torch.float32 and f.shape == x.shape, name
        size = x.abs().max()
        err_found = float((f.double() - x).abs().max() / size)
        err_eager = float((e.double() - x).abs().max() / size)
        assert err_found <= max(4 * err_eager, 32 * U32), (name, err_found, err_eager)


@pytest.mark.parametrize("with_tau", [False, True], ids=["no_tau", "tau"])
@pytest.mark.parametrize("kind", ["full", "padded"])
def test_pre_sbn_as_close_to_float64_as_the_eager_function(kind, with_tau):
    """y (τ·y), μ, σ², ∂x and ∂τ against BatchStandardiseNormalise (times τ, through
    autograd) in float32 and float64; padded rows, those of a fully padded sequence too, are
    standardised with the real rows' statistics and get the correction-free gradient."""
    gen = _gen(0)
    x = _randn(B, H, L, D, gen=gen, scale=2.0, shift=0.3)
    g = _randn(B, H, L, D, gen=gen)
    tau = (torch.rand(H, 1, 1, generator=gen) * 3 + 1).to(DEVICE) if with_tau else None
    mask = _mask(kind)
    found = _pre("triton", x, mask, tau, g)
    eager = _pre("eager", x, mask, tau, g)
    exact = _pre("eager", x.double(), mask, tau, g)
    names = ["y", "μ", "σ²", "∂x", "∂τ"]
    _assert_as_close_as_eager(names, found, eager, exact)


@pytest.mark.parametrize("gamma", ["head", "shared"])
def test_post_sbn_as_close_to_float64_as_the_eager_function(gamma):
    gen = _gen(1)
    out, g = _randn(B, H, L, D, gen=gen), _randn(B, H, L, D, gen=gen)
    Hg = 1 if gamma == "shared" else H
    gamma_ = (torch.rand(Hg, 1, D, generator=gen) + 0.5).to(DEVICE)
    log_beta = (torch.rand(Hg, 1, D, generator=gen) * 0.6 - 0.3).to(DEVICE)
    found = _post(TritonPostSBN, out, gamma_, log_beta, g)
    eager = _post(PostSBN, out, gamma_, log_beta, g)
    exact = _post(PostSBN, out.double(), gamma_.double(), log_beta.double(), g)
    _assert_as_close_as_eager(["result", "∂out", "∂γ", "∂logβ"], found, eager, exact)


def test_post_sbn_power_within_its_rounding_bound():
    """The Triton power within the native kernel's rounding bound over float32's range
    (``assert_post_sbn_power_within_bound``): CUDA's logf and expf are within 2 ulp, the
    interpreter's are NumPy's in float64, rounded."""
    assert_post_sbn_power_within_bound(TritonPostSBN.apply, (1, H, 250, D), _gen(2), DEVICE)


def test_bfloat16_input_read_exactly_and_its_gradient_rounded_as_a_cast():
    """A bfloat16 x (autocast's projections) gives the same bits as x cast to float32 first,
    and ∂x is that float32 gradient rounded to bfloat16 to nearest even (autograd's cast)."""
    gen = _gen(3)
    x = _randn(B, H, L, D, gen=gen, scale=2.0).bfloat16()
    g = _randn(B, H, L, D, gen=gen)
    tau = (torch.rand(H, 1, 1, generator=gen) + 1).to(DEVICE)
    mask = _mask("padded")
    read = _pre("triton", x, mask, tau, g)
    cast = _pre("triton", x.float(), mask, tau, g)
    for name, a, b in zip(["y", "μ", "σ²"], read, cast):
        assert torch.equal(a, b), name
    assert read[3].dtype == torch.bfloat16 and torch.equal(read[3], cast[3].bfloat16())
    assert torch.equal(read[4], cast[4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_views_read_and_written_in_place(dtype):
    """q and k come as (B, H, L, d) views of the (B, L, H, d) projections: read there, with
    the same bits as from a contiguous copy, and ∂x written in that layout. Post-SBN reads a
    view, writes its result in the heads' merged layout and reads the merged gradient where
    it is: the same bits as from contiguous tensors."""
    gen = _gen(4)
    x = _randn(B, L, H, D, gen=gen, scale=2.0).to(dtype)
    g = _randn(B, L, H, D, gen=gen)
    mask = _mask("padded")
    view = x.transpose(1, 2)
    in_place = _pre("triton", view, mask, None, g.transpose(1, 2))
    copied = _pre("triton", view.contiguous(), mask, None, g.transpose(1, 2).contiguous())
    assert in_place[3].stride() == view.stride()
    for name, a, b in zip(["y", "μ", "σ²", "∂x"], in_place, copied):
        assert torch.equal(a, b), name
    if dtype == torch.bfloat16:
        return
    gamma, log_beta = torch.rand(H, 1, D, device=DEVICE) + 0.5, torch.zeros(H, 1, D, device=DEVICE)
    in_place = _post(TritonPostSBN, view, gamma, log_beta, g.transpose(1, 2))
    copied = _post(
        TritonPostSBN, view.contiguous(), gamma, log_beta, g.transpose(1, 2).contiguous()
    )
    assert in_place[0].transpose(1, 2).is_contiguous()  # the heads' merged layout
    for name, a, b in zip(["result", "∂out", "∂γ", "∂logβ"], in_place, copied):
        assert torch.equal(a, b), name


def test_the_same_bits_on_every_call():
    """No atomics: the partial sums are added in a fixed order."""
    gen = _gen(5)
    x, g = _randn(B, H, L, D, gen=gen, scale=2.0), _randn(B, H, L, D, gen=gen)
    tau = (torch.rand(H, 1, 1, generator=gen) + 1).to(DEVICE)
    gamma, log_beta = torch.rand(1, 1, D, device=DEVICE) + 0.5, torch.zeros(1, 1, D, device=DEVICE)
    runs = [
        _pre("triton", x, _mask("padded"), tau, g) + _post(TritonPostSBN, x, gamma, log_beta, g)
        for _ in range(2)
    ]
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), i


def _ppsbn(triton: bool, **extra):
    attn = build_attention(
        "softmax", head_dim=D, num_heads=H, pre_sbn=True, post_sbn=True, temperature_max=32.0,
        temperature_init=4.0, triton_sbn=triton, **extra,
    )  # fmt: skip
    gen = _gen(6)
    with torch.no_grad():
        attn.gamma.copy_(torch.rand(attn.gamma.shape, generator=gen) + 0.5)
        attn.log_beta.copy_(torch.rand(attn.log_beta.shape, generator=gen) * 0.6 - 0.3)
    return attn


def _run(attn, q, k, v, mask, grad, dtype):
    """``ppsbn_step_results`` on this file's device."""
    return ppsbn_step_results(attn, q, k, v, mask, grad, dtype, DEVICE)


NAMES = "out ∂q ∂k ∂v ∂γ ∂logβ ∂τ running_mean running_var eval_out".split()


def _spy(monkeypatch) -> list[str]:
    """The Triton Functions' and normalisation's calls in ppsbn.py, in order."""
    calls = []
    for name in ("TritonStandardiseNormalise", "TritonPostSBN"):
        fn = getattr(ppsbn_module, name)
        monkeypatch.setattr(
            fn, "apply", lambda *a, _real=fn.apply, _name=name: calls.append(_name) or _real(*a)
        )
    real = ppsbn_module.triton_normalise
    monkeypatch.setattr(
        ppsbn_module, "triton_normalise", lambda *a: calls.append("normalise") or real(*a)
    )
    return calls


def test_attention_with_triton_sbn_as_close_to_float64_as_eager(monkeypatch):
    """The whole ppSBN attention (softmax inside, padding, temperature) with ``triton_sbn:
    true`` and false on the same inputs and parameters: every output, gradient and running
    estimate within the bound above of the float64 attention; the kernels ran where they
    should (pre-SBN of q and k and post-SBN in training, the running estimates'
    normalisation of q and k in evaluation)."""
    gen = _gen(7)
    q, k, v = (_randn(B, H, L, D, gen=gen, scale=2.0, shift=0.3) for _ in range(3))
    grad = _randn(B, H, L, D, gen=gen)
    mask = _mask("padded")
    mask[2, :5] = True  # every sequence needs a real key for softmax
    exact = _run(_ppsbn(False), q, k, v, mask, grad, torch.float64)
    eager = _run(_ppsbn(False), q, k, v, mask, grad, torch.float32)
    calls = _spy(monkeypatch)
    found = _run(_ppsbn(True), q, k, v, mask, grad, torch.float32)
    assert calls == ["TritonStandardiseNormalise"] * 2 + ["TritonPostSBN"] + ["normalise"] * 2 + [
        "TritonPostSBN"
    ]
    _assert_as_close_as_eager(NAMES, found, eager, exact)


def test_float64_takes_the_eager_passes():
    gen = _gen(8)
    q, k, v, grad = (_randn(B, H, L, D, gen=gen) for _ in range(4))
    mask = _mask("full")
    triton = _run(_ppsbn(True), q, k, v, mask, grad, torch.float64)
    eager = _run(_ppsbn(False), q, k, v, mask, grad, torch.float64)
    for name, a, b in zip(NAMES, triton, eager):
        assert torch.equal(a, b), name
