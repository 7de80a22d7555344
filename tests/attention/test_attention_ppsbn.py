"""ppSBN (docs/maths.md §10): masked statistics, running estimates, post-SBN identity at init, its
sign-preserving positive power, the bounded temperature, leak-free decoder statistics, DDP."""

from __future__ import annotations

import copy
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from macformer_lit.attention import build_attention
from macformer_lit.attention import pieces as pieces_module

D, H = 8, 2


def _qkv(B=3, N=10, seed=0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64) * 2 + shift for _ in range(3)]


def _capture_inner(attn):
    seen = {}
    attn.inner.register_forward_hook(
        lambda m, a, kw, out: seen.update(q=a[0], k=a[1]), with_kwargs=True
    )
    return seen


def test_statistics_skip_padding_and_running_estimates_follow():
    attn = build_attention(
        "softmax", head_dim=D, num_heads=H, pre_sbn=True, sbn_momentum=0.5
    ).double()
    q, k, v = _qkv(shift=1.0)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = False
    q_junk = q.clone()
    q_junk[1, :, 6:] = 1e3  # padded queries must not move the statistics
    attn.train()(q_junk, k, v, key_padding_mask=mask, query_padding_mask=mask)
    real = q.permute(1, 0, 2, 3)[:, mask]  # (H, n, d)
    torch.testing.assert_close(attn.running_mean[0], 0.5 * real.mean(1))
    torch.testing.assert_close(attn.running_var[0], 0.5 + 0.5 * real.var(1, unbiased=True))


def test_eval_is_per_sample_and_bounds_the_logits():
    attn = build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True).double()
    q, k, v = _qkv()
    attn.train()(q, k, v)
    attn.eval()
    seen = _capture_inner(attn)
    full = attn(q, k, v)
    logits = seen["q"] @ seen["k"].transpose(-1, -2) / math.sqrt(D)
    assert logits.abs().max() <= 1 / math.sqrt(D) + 1e-12
    torch.testing.assert_close(attn(q[:1], k[:1], v[:1]), full[:1])


def test_post_sbn_is_identity_at_init_then_a_signed_power():
    q, k, v = _qkv()
    bare = build_attention("softmax", head_dim=D, num_heads=H).double()
    post = build_attention("softmax", head_dim=D, num_heads=H, post_sbn=True).double()
    torch.testing.assert_close(post(q, k, v), bare(q, k, v), rtol=0, atol=0)
    with torch.no_grad():
        post.gamma.fill_(2.0)
        post.log_beta.fill_(math.log(0.5))
    y = 2.0 * bare(q, k, v)
    expected = torch.sign(y) * y.abs().sqrt()
    torch.testing.assert_close(post(q, k, v), expected)
    assert (post(q, k, v) < 0).any()  # signs survive a fractional power
    # β = e^−50 ≈ 2e-22 is still a positive power: |γy|^β = exp(β·ln|γy|) rounds to 1, so the
    # output is sign(y) (a β taken as log_beta itself, −50, would blow |γy|^β up instead).
    with torch.no_grad():
        post.log_beta.fill_(-50.0)
    torch.testing.assert_close(post(q, k, v), torch.sign(y))


def test_temperature_starts_at_one_is_bounded_and_learns():
    q, k, v = _qkv()
    torch.manual_seed(0)
    plain = build_attention("rmfa", head_dim=D, num_heads=H, pre_sbn=True).double()
    torch.manual_seed(0)
    hot = build_attention(
        "rmfa", head_dim=D, num_heads=H, pre_sbn=True, temperature_max=2.0
    ).double()
    torch.testing.assert_close(hot(q, k, v), plain(q, k, v))
    hot(q, k, v).pow(2).sum().backward()
    assert hot.temperature_logit.grad.abs().sum() > 0
    with torch.no_grad():
        hot.temperature_logit.copy_(torch.tensor([-1e6, 1e6]).view(H, 1, 1))
    torch.testing.assert_close(hot.temperature().flatten(), torch.tensor([0.5, 2.0]).double())


def test_row_statistics_option():
    attn = build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True, sbn_stats="row")
    seen = _capture_inner(attn.double())
    q, k, v = _qkv()
    attn(q, k, v)
    centred = q - q.mean(-1, keepdim=True)
    torch.testing.assert_close(seen["q"], centred / centred.norm(dim=-1, keepdim=True))


def test_row_statistics_gradients_equal_the_two_step_form():
    """``sbn_stats: row`` computes (x − μ)/max(‖x − μ‖, 1e-12·σ) in one reduction; its output
    and gradient equal the two written steps (standardise per row, then normalise) in
    float64, a constant row (centred to zero: the guards act) included, finite there."""
    attn = build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True, sbn_stats="row")
    attn = attn.double()
    x0 = torch.randn(2, H, 5, D, dtype=torch.float64)
    x0[1, 0, 2] = 3.0  # a constant row
    weight = torch.randn_like(x0)
    results = []
    for form in ("one", "two"):
        x = x0.clone().requires_grad_()
        if form == "one":
            y = attn._pre_sbn_eager(x, None, 0, update=False)
        else:
            z = x - x.mean(-1, keepdim=True)
            z = z / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + attn.sbn_eps)
            y = torch.nn.functional.normalize(z, dim=-1)
        (y * weight).sum().backward()
        results.append((y, x.grad))
    for ours, two_step in zip(*results):
        torch.testing.assert_close(ours, two_step)
    assert torch.equal(results[0][0][1, 0, 2], torch.zeros(D, dtype=torch.float64))
    assert results[0][1].isfinite().all()


@pytest.mark.parametrize("train_stats,leaks", [("batch", True), ("running", False)])
def test_decoder_cross_attention_statistics(train_stats, leaks):
    """Cross-attention queries from a decoder: batch statistics let later queries move earlier
    outputs; ``sbn_train_stats: running`` does not."""
    attn = build_attention(
        "softmax", head_dim=D, num_heads=H, pre_sbn=True, sbn_train_stats=train_stats
    ).double()
    q, k, v = _qkv()
    q2 = q.clone()
    q2[:, :, 5:] += 3.0
    out, out2 = copy.deepcopy(attn)(q, k, v), copy.deepcopy(attn)(q2, k, v)
    moved = not torch.allclose(out[:, :, :5], out2[:, :, :5], rtol=0, atol=1e-12)
    assert moved == leaks


def test_restricted_kernel_temperature_bound():
    with pytest.raises(ValueError, match="temperature_max"):
        build_attention(
            "rmfa", head_dim=D, num_heads=H, kernel="inv", pre_sbn=True, temperature_max=3.0
        )
    build_attention(
        "rmfa", head_dim=D, num_heads=H, kernel="inv", pre_sbn=True, temperature_max=2.0
    )


def _weights(shape):
    return torch.linspace(-1, 1, math.prod(shape), dtype=torch.float64).view(shape)


def _ddp_worker(rank, port, q, k, v, mask, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        attn = build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True).double()
        shard = slice(rank * 2, rank * 2 + 2)
        q_, k_ = (t[shard].clone().requires_grad_() for t in (q, k))
        out = attn(
            q_,
            k_,
            v[shard],
            key_padding_mask=mask[shard],
            query_padding_mask=mask[shard],
        )
        (out * _weights(q.shape)[shard]).sum().backward()
        results[rank] = (attn.running_mean.clone(), attn.running_var.clone(), q_.grad, k_.grad)
    finally:
        torch.distributed.destroy_process_group()


def test_statistics_are_synchronised_across_ranks():
    q, k, v = _qkv(B=4)
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[3, 4:] = False
    single = build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True).double()
    q_, k_ = (t.clone().requires_grad_() for t in (q, k))
    out = single(q_, k_, v, key_padding_mask=mask, query_padding_mask=mask)
    (out * _weights(q.shape)).sum().backward()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(port, q, k, v, mask, results), nprocs=2)
    for rank in range(2):
        torch.testing.assert_close(results[rank][0], single.running_mean)
        torch.testing.assert_close(results[rank][1], single.running_var)
        # The batch statistics couple the ranks' examples: a rank's gradient equals the
        # single-process gradient of the whole batch only if the backward sums cross ranks.
        shard = slice(rank * 2, rank * 2 + 2)
        torch.testing.assert_close(results[rank][2], q_.grad[shard], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(results[rank][3], k_.grad[shard], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_pre_sbn_and_post_sbn_gradients_are_exact(monkeypatch, masked, pieces):
    """The hand-written backward passes of pre-SBN (batch statistics, row normalisation) and
    post-SBN against finite differences, padded rows included, and γ, β against autograd
    through the float64 reference; whole, and over the batch one entry a piece."""
    from macformer_lit.attention.eager_sbn import BatchStandardiseNormalise, PostSBN

    if pieces:
        monkeypatch.setattr(pieces_module, "PIECE_BYTES", 1)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, H, 7, D, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(3, 7, dtype=torch.bool)
    if masked:
        mask[1, 4:] = False
        mask[2, 6:] = False
    w = mask[:, None, :, None].double() if masked else None
    n = mask.sum().double()

    def pre(t):
        return BatchStandardiseNormalise.apply(t, w, n, 1e-13)[0]

    assert torch.autograd.gradcheck(pre, (x,))
    gamma = (torch.rand(H, 1, D, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    log_beta = (torch.rand(H, 1, D, generator=g, dtype=torch.float64) - 0.5) * 0.6
    log_beta.requires_grad_()
    assert torch.autograd.gradcheck(PostSBN.apply, (x, gamma, log_beta))


@pytest.mark.parametrize("name", ["softmax", "rmfa"])
def test_ppsbn_parameter_gradients_match_reference(name):
    from macformer_lit.attention.reference import reference_forward

    attn = build_attention(
        name, head_dim=D, num_heads=H, pre_sbn=True, post_sbn=True, temperature_max=2.0
    ).double()
    with torch.no_grad():
        attn.gamma.uniform_(0.5, 1.5)
        attn.log_beta.uniform_(-0.3, 0.3)
        attn.temperature_logit.fill_(0.3)
    q, k, v = _qkv(B=3, N=9)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, 5:] = False
    grads = []
    for fn in (lambda *a, **kw: reference_forward(attn, *a, **kw), attn):
        attn.zero_grad()
        out = fn(q, k, v, key_padding_mask=mask, query_padding_mask=mask)
        (out * mask[:, None, :, None] * _weights(out.shape)).sum().backward()
        grads.append([p.grad.clone() for p in (attn.gamma, attn.log_beta, attn.temperature_logit)])
    for expected, actual, what in zip(*grads, ("gamma", "log_beta", "temperature")):
        torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10, msg=what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softmax", "rmfa"])
def test_ppsbn_in_batch_pieces_gives_the_same_bits(monkeypatch, name, causal):
    """On the CPU ppSBN's passes run over the batch in pieces of PIECE_BYTES (pieces.py: the
    Text preset's q is 33 MB, a fresh mmap for every temporary). One entry a piece must give
    the same bits as the whole batch at once: training output, every input and parameter
    gradient, the running statistics, and the evaluation output, with padding."""
    torch.manual_seed(0)
    attn = build_attention(name, head_dim=D, num_heads=H, pre_sbn=True, post_sbn=True)
    with torch.no_grad():
        attn.gamma.uniform_(0.5, 1.5)
        attn.log_beta.uniform_(-0.3, 0.3)
    B, N = 5, 23
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    mask = torch.rand(B, N) > 0.2
    mask[:, 0] = True
    grad = torch.randn(B, H, N, D)
    runs = []
    for budget in (1 << 40, 1):
        monkeypatch.setattr(pieces_module, "PIECE_BYTES", budget)
        assert len(pieces_module.batch_slices(q)) == (1 if budget > 1 else B)
        model = copy.deepcopy(attn).train()
        for t in (q, k, v):
            t.grad = None
        out = model(q, k, v, key_padding_mask=mask, causal=causal)
        out.backward(grad)
        with torch.no_grad():
            evaluated = model.eval()(q, k, v, key_padding_mask=mask, causal=causal)
        runs.append(
            [out.detach(), q.grad, k.grad, v.grad, model.gamma.grad, model.log_beta.grad]
            + [model.running_mean, model.running_var, evaluated]
        )
    for whole, piecewise in zip(*runs):
        assert torch.equal(whole, piecewise)


@pytest.mark.parametrize(
    "name, options",
    [
        ("maclaurin", {}),
        ("maclaurin", {"native_fused": True, "native_sbn": True, "feature_dtype": "bfloat16"}),
        ("rmfa", {}),
        ("favor", {}),
    ],
    ids=["maclaurin", "maclaurin_fused_bf16", "rmfa", "favor"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_bfloat16_values_reach_a_feature_backend_uncast(name, options, causal):
    """Under bf16 autocast v arrives in bfloat16; around a feature backend ppSBN passes it on
    as it is, and the backend casts it where it builds [v, 1] (padded keys' rows zeroed in
    place there). The same bits as casting v to float32 first: the output, and ∂v rounded
    to bfloat16 as autograd's cast rounds it; padded keys' values, whatever they hold, do not
    reach the output."""
    from macformer_lit.attention.native_map import cxx_compiler

    if options and cxx_compiler() is None:
        pytest.skip("needs a C++ compiler")
    B, N, dh = 3, 12, 16  # head size 16: the fused kernel's smallest
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(B, H, N, dh, generator=g) for _ in range(4))
    v = v.bfloat16()
    v[1, :, 9:] = float("nan")  # padded keys: never read
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 9:] = False
    torch.manual_seed(0)
    attn = build_attention(
        name, head_dim=dh, num_heads=H, pre_sbn=True, post_sbn=True, **options
    ).train()
    found = []
    for cast in (False, True):
        model = copy.deepcopy(attn)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        vv = leaves[2].float() if cast else leaves[2]
        out = model(leaves[0], leaves[1], vv, key_padding_mask=mask, causal=causal)
        out.backward(grad)
        found.append([out.detach(), *(t.grad for t in leaves)])
    assert found[0][0].isfinite().all()
    for what, a, b in zip(["out", "∂q", "∂k", "∂v"], *found):
        assert a.dtype == b.dtype and torch.equal(a, b), what
