"""ppSBN's native passes (``native_sbn: true``, attention/native_sbn.py): post-SBN's power within
its float32 rounding bound (exp and log are the kernel's own polynomials), the whole ppSBN
attention's output, input and parameter gradients and running estimates no further from
float64 than the eager float32 path's, the same bits on any thread count, the same
statistics across DDP ranks, float64 left to the eager functions, and the option's
refusals and its choice under ``auto_kernels``."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from native_support import (
    CXX,
    U32,
    assert_post_sbn_power_within_bound,
    needs_cxx,
    ppsbn_step_results,
)

from macformer_lit.attention import build_attention
from macformer_lit.attention import ppsbn as ppsbn_module
from macformer_lit.attention.native_sbn import NativePostSBN

pytestmark = needs_cxx

H, D = 2, 32


def _ppsbn(name, native, gamma="head", **extra):
    kw = dict(pre_sbn=True, post_sbn=True, temperature_max=32.0, temperature_init=4.0)
    attn = build_attention(
        name, head_dim=D, num_heads=H, native_sbn=native, post_sbn_gamma=gamma, **kw, **extra
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        attn.gamma.copy_(torch.rand(attn.gamma.shape, generator=g) + 0.5)
        attn.log_beta.copy_(torch.rand(attn.log_beta.shape, generator=g) * 0.6 - 0.3)
    return attn


def _run(attn, q, k, v, mask, grad, dtype):
    """``ppsbn_step_results`` in float64."""
    return [t.double() for t in ppsbn_step_results(attn, q, k, v, mask, grad, dtype)]


NAMES = "out ∂q ∂k ∂v ∂γ ∂logβ ∂τ running_mean running_var eval_out".split()


def _inputs(masked, B=3, N=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) * 2 + 0.3 for _ in range(3))
    mask = torch.ones(B, N, dtype=torch.bool)
    if masked:
        mask[1, 20:] = False
        mask[2, 30:] = False
    return q, k, v, mask, torch.randn(B, H, N, D, generator=g)


@pytest.mark.parametrize("gamma", ["head", "shared"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", ["maclaurin", "softmax"])
def test_no_further_from_float64_than_the_eager_passes(name, masked, gamma):
    """Every result's worst error (relative to its largest float64 value) is at most 4× the
    eager float32 path's worst error, or 32 float32 roundings where that is smaller: the
    native passes compute the same maths with fewer roundings (sums in float64), so they
    are no less accurate than the passes they replace (measured here: 0.3–1.6×)."""
    q, k, v, mask, grad = _inputs(masked)
    extra = {"native_fused": True} if name == "maclaurin" else {}
    exact = _run(_ppsbn(name, False, gamma, **extra), q, k, v, mask, grad, torch.float64)
    eager = _run(_ppsbn(name, False, gamma, **extra), q, k, v, mask, grad, torch.float32)
    native = _run(_ppsbn(name, True, gamma, **extra), q, k, v, mask, grad, torch.float32)
    for what, e64, e32, n32 in zip(NAMES, exact, eager, native):
        size = e64.abs().max()
        err_eager, err_native = (e32 - e64).abs().max() / size, (n32 - e64).abs().max() / size
        assert err_native <= max(4 * err_eager, 32 * U32), (what, err_native, err_eager)


def test_post_sbn_power_within_its_rounding_bound():
    """The native power within its rounding bound over float32's range
    (``assert_post_sbn_power_within_bound``). The gradients' sums are covered above."""
    gen = torch.Generator().manual_seed(0)
    power = lambda *args: NativePostSBN.apply(*args, CXX)  # noqa: E731
    assert_post_sbn_power_within_bound(power, (4, H, 4000, D), gen)


def test_same_bits_on_any_thread_count():
    q, k, v, mask, grad = _inputs(True, B=5, N=41, seed=1)
    attn = _ppsbn("softmax", True)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(_run(attn, q, k, v, mask, grad, torch.float32))
    finally:
        torch.set_num_threads(before)
    for what, *found in zip(NAMES, *runs):
        assert all(torch.equal(found[0], other) for other in found[1:]), what


def test_float64_takes_the_eager_passes():
    q, k, v, mask, grad = _inputs(True)
    native = _run(_ppsbn("softmax", True), q, k, v, mask, grad, torch.float64)
    eager = _run(_ppsbn("softmax", False), q, k, v, mask, grad, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(native, eager))


def _ddp_worker(rank, port, q, k, v, mask, grad, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shard = slice(rank * 2, rank * 2 + 2)
        found = _run(_ppsbn("softmax", True), q[shard], k[shard], v[shard], mask[shard],
                     grad[shard], torch.float32)  # fmt: skip
        results[rank] = found[1:3] + found[7:9]
    finally:
        torch.distributed.destroy_process_group()


def test_statistics_and_their_backward_cross_ranks():
    """Two ranks of two entries each against one process with all four: the moments and
    the backward's per-channel sums all-reduced between the passes, so the running
    estimates and each rank's input gradients are the whole batch's (float32 apart)."""
    q, k, v, mask, grad = _inputs(True, B=4)
    mask[3, 5:] = False
    whole = _run(_ppsbn("softmax", True), q, k, v, mask, grad, torch.float32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(port, q, k, v, mask, grad, results), nprocs=2)
    for rank in range(2):
        shard = slice(rank * 2, rank * 2 + 2)
        gq, gk, mean, var = results[rank]
        torch.testing.assert_close(gq, whole[1][shard], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gk, whole[2][shard], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mean, whole[7], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(var, whole[8], rtol=1e-6, atol=1e-7)


def test_refusals_and_the_automatic_choice(monkeypatch):
    with pytest.raises(ValueError, match="native_sbn act on pre-SBN and post-SBN"):
        build_attention("softmax", head_dim=D, num_heads=H, native_sbn=True)
    auto = build_attention("maclaurin", head_dim=D, num_heads=H, pre_sbn=True, auto_kernels=True)
    assert auto.native_sbn
    monkeypatch.setattr(ppsbn_module, "cxx_compiler", lambda: None)
    with pytest.raises(ValueError, match="native_sbn: true needs a C\\+\\+ compiler"):
        build_attention("softmax", head_dim=D, num_heads=H, pre_sbn=True, native_sbn=True)


def test_bfloat16_queries_and_keys_read_without_a_cast():
    """Under bf16 autocast q and k arrive in bfloat16: the native batch-statistics pass reads
    them as they are. The same bits as casting them to float32 first: the output, and the
    input gradients rounded to bfloat16 to nearest even as autograd's cast rounds them."""
    q, k, v, mask, grad = _inputs(True)
    attn = _ppsbn("maclaurin", True, native_fused=True).train()
    q, k, v, grad = (t.bfloat16() for t in (q, k, v, grad))
    found = []
    for cast in (False, True):
        model = copy.deepcopy(attn)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qq, kk = (t.float() for t in leaves[:2]) if cast else leaves[:2]
        out = model(qq, kk, leaves[2], key_padding_mask=mask)
        out.backward(grad.to(out.dtype))
        found.append([out.detach().bfloat16(), *(t.grad for t in leaves), model.running_var])
    for what, a, b in zip(["out", "∂q", "∂k", "∂v", "running_var"], *found):
        assert a.dtype == b.dtype and torch.equal(a, b), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_projections_layout_read_and_written_in_place(dtype):
    """q and k come as (B, H, N, d) views of the (B, N, H, d) projections: the native pass
    reads them there and writes their gradients in that layout (the view's backward then
    copies nothing); post-SBN writes its result in the heads' merged layout and reads the
    merged gradient there: the same bits as from contiguous copies, in training and in
    evaluation (the running estimates' pass)."""
    q, k, v, mask, grad = _inputs(True)
    attn = _ppsbn("maclaurin", True, native_fused=True).train()
    q, k, v = (t.to(dtype) for t in (q, k, v))
    found = []
    for layout in ("contiguous", "projection"):
        model = copy.deepcopy(attn)
        leaves = [t.transpose(1, 2).contiguous().clone().requires_grad_() for t in (q, k, v)]
        views = [t.transpose(1, 2) for t in leaves]  # (B, H, N, d), not contiguous
        if layout == "contiguous":
            views = [t.contiguous() for t in views]
        arriving = []  # the strides of the gradients q's and k's views receive
        for t in views[:2]:
            t.register_hook(lambda g, seen=arriving: seen.append(g.stride()))
        out = model(*views, key_padding_mask=mask)
        # Post-SBN's result in the heads' merged layout: the merge is a view, and the
        # merged gradient reaches post-SBN's backward in that layout.
        assert out.transpose(1, 2).is_contiguous()
        B, _, N, _ = out.shape
        merged = out.transpose(1, 2).reshape(B, N, H * D)
        merged.backward(grad.to(out.dtype).transpose(1, 2).reshape(B, N, H * D))
        with torch.no_grad():
            evaluated = model.eval()(*views, key_padding_mask=mask)
        found.append([out.detach(), *(t.grad for t in leaves), model.running_var, evaluated])
        assert sorted(arriving) == sorted(t.stride() for t in views[:2]), layout
    for what, a, b in zip(["out", "∂q", "∂k", "∂v", "running_var", "eval_out"], *found):
        assert a.dtype == b.dtype and torch.equal(a, b), what
