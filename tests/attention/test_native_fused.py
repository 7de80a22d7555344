"""The fused Maclaurin products (attention/native_fused.py): within float32's
rounding of the float64 products and of their exact gradients, the same bits on any thread
count, no feature rows kept for the backward, and the attention it serves, bidirectional and
causal, equal to the unfused float32 one (float64 untouched). Its refusals are tested with the
native map's (test_native_map.py)."""

from __future__ import annotations

import pytest
import torch
from native_support import CXX, assert_within_float32_rounding, needs_cxx, saved_sizes, spied
from native_support import scale as _scale

from macformer_lit.attention import build_attention
from macformer_lit.attention import maclaurin as maclaurin_module
from macformer_lit.attention.native_fused import amx_tiles, bf16_dot, native_fused_products

pytestmark = needs_cxx


@pytest.fixture(params=["avx512_bf16", "amx"])
def bf16_path(request):
    """The bfloat16 products on each path this machine has: the AVX512-BF16 loops, and AMX
    tiles where the CPU has them (Intel Sapphire Rapids and later); the default restored."""
    if CXX is None or not bf16_dot(CXX):
        pytest.skip("no AVX512-BF16 dot products")
    amx = request.param == "amx"
    if amx and not amx_tiles(CXX):
        pytest.skip("no AMX tiles on this CPU")
    default = amx_tiles(CXX)
    assert amx_tiles(CXX, amx) == amx
    yield request.param
    amx_tiles(CXX, default)


# 16, 32, 48, 64: every head size the kernel has. N = 37 and M = 70: one tile of 32 and a
# part, three tiles with the last a part; the row blocks' remainders too.
@pytest.mark.parametrize("d", [16, 32, 48, 64])
def test_products_and_gradients_within_float32_rounding(d):
    """Every entry of the products and of the three gradients is a sum of products of float32
    roundings of the same float64 terms: the feature entries (at most 3 roundings each), the
    state's sum over M keys, the apply's over D' features, the pullback's over d + 1 columns
    and its map backward's over 2d + 8 (test_native_map.py), so within γ_K·Σ|terms| with
    K = max(N, M) + D' + 3(d + 1) + 16 rounding steps on the longest path. Σ|terms| is the same
    expression at |q|, |k|, |v1|, |∂out| (every term is a product with non-negative scales)."""
    gen = torch.Generator().manual_seed(d)
    N, M = 37, 70
    q, k = torch.randn(2, 3, N, d, generator=gen), torch.randn(2, 3, M, d, generator=gen)
    v1, g = torch.randn(2, 3, M, d + 1, generator=gen), torch.randn(2, 3, N, d + 1, generator=gen)
    D = 1 + d + d * (d + 1) // 2
    assert_within_float32_rounding(
        lambda *leaves: native_fused_products(*leaves, _scale(d), CXX),
        q, k, v1, g, _scale(d), steps=max(N, M) + D + 3 * (d + 1) + 16,
    )  # fmt: skip


@pytest.mark.parametrize("d", [16, 32, 48, 64])
def test_bf16_inputs_within_four_roundings(d, bf16_path):
    """With bfloat16 inputs every term of the products and of the three gradients is a
    product of four factors rounded to bfloat16 once each (out: φ(q), φ(k), v1 and the state
    S; ∂q: S's φ(k) and v1, S, ∂out; ∂k: ∂S's φ(q) and ∂out, ∂S, v1; ∂v1: ∂S's two, ∂S,
    φ(k)), on top of the float32 roundings of the float32 test: within
    ((1 + 2⁻⁸)⁴(1 + γ_K) − 1)·Σ|terms|; and rounded (each result's worst error relative to
    Σ|terms| over 100 times the float32 kernel's). N = 37 and M = 170: odd tiles, so a row
    pairs with zeros; every row block's remainder; on AMX, tiles padded with zeros and the
    state's rows in chunks of four tiles, one whole and one a part."""
    gen = torch.Generator().manual_seed(100 + d)
    N, M = 37, 170
    q, k = torch.randn(2, 3, N, d, generator=gen), torch.randn(2, 3, M, d, generator=gen)
    v1, g = torch.randn(2, 3, M, d + 1, generator=gen), torch.randn(2, 3, N, d + 1, generator=gen)
    D = 1 + d + d * (d + 1) // 2
    worst = {}
    for bf16 in (False, True):
        worst[bf16] = assert_within_float32_rounding(
            lambda *leaves, bf16=bf16: native_fused_products(*leaves, _scale(d), CXX, bf16=bf16),
            q, k, v1, g, _scale(d), steps=max(N, M) + D + 3 * (d + 1) + 16,
            bf16_roundings=4 if bf16 else 0,
        )  # fmt: skip
    for name, low, high in zip(["out", "∂q", "∂k", "∂v1"], worst[True], worst[False]):
        assert low > 100 * high, (name, low, high)


def test_same_bits_on_any_thread_count_float32():
    same_bits_on_any_thread_count(bf16=False)


def test_same_bits_on_any_thread_count_bf16_inputs(bf16_path):
    same_bits_on_any_thread_count(bf16=True)


def same_bits_on_any_thread_count(bf16):
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 2, 101, 32, generator=gen), torch.randn(3, 2, 77, 32, generator=gen)
    v1, g = torch.randn(3, 2, 77, 33, generator=gen), torch.randn(3, 2, 101, 33, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            leaves = [t.clone().requires_grad_() for t in (q, k, v1)]
            out = native_fused_products(*leaves, _scale(32), CXX, bf16)
            results.append((out, *torch.autograd.grad(out, leaves, g)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_no_feature_rows_kept_for_the_backward():
    """The rows are built again in the backward: no tensor the attention keeps is as large as
    one side's feature rows (N·D' floats a head), and all it keeps together are less than the
    rows of q and k that the unfused attention keeps (with its other tensors)."""
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0)
    unfused = build_attention(spec, head_dim=32, num_heads=2)
    fused = build_attention({**spec, "native_fused": True}, head_dim=32, num_heads=2)
    q, k, v = (torch.randn(2, 2, 512, 32, requires_grad=True) for _ in "qkv")
    one_side = 2 * 2 * 512 * 561 * 4
    kept_unfused = saved_sizes(lambda: unfused(q, k, v))
    kept_fused = saved_sizes(lambda: fused(q, k, v))
    assert sum(kept_unfused) > 2 * one_side
    assert max(kept_fused) < one_side and sum(kept_fused) < 2 * one_side, kept_fused


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_attention_equals_the_unfused_float32_one(causal, monkeypatch):
    """In ppSBN with padding, N = 90 (causal: a chunk of 64 and a part), the fused products
    agree with the float32 GEMMs to float32 rounding, forward and the three gradients (causal:
    the chunks' states through the state and apply primitives, the chunk itself through its
    kernel values); a spy checks that the fused entry point ran."""
    calls = spied(
        monkeypatch, maclaurin_module, ["native_fused_products", "native_causal_products"]
    )
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0)
    unfused = build_attention(spec, head_dim=32, num_heads=2)
    fused = build_attention({**spec, "native_fused": True}, head_dim=32, num_heads=2)
    fused.load_state_dict(unfused.state_dict())
    g = torch.Generator().manual_seed(3)
    q0, k0, v0 = (torch.randn(2, 2, 90, 32, generator=g) for _ in "qkv")
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[1, 60:] = False
    results = []
    for attn in (unfused, fused):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attn(q, k, v, key_padding_mask=mask, causal=causal)
        (out * mask[:, None, :, None]).square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    assert calls == ["native_causal_products" if causal else "native_fused_products"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _Inputs(torch.overrides.TorchFunctionMode):
    """The first arguments of the torch calls whose name contains ``name``."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.inputs = name, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.name in getattr(func, "__name__", "") and args:
            self.inputs.append(args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("feature_dtype", ["float32", "bfloat16"])
def test_padded_keys_need_no_zeroing(causal, feature_dtype):
    """The fused path leaves k's padded rows as they are (one masked pass, [v, 1]'s, not two):
    whatever they hold, the output and every gradient are the same bits as with them zero,
    and k's gradient there is zero."""
    attn = build_attention(
        dict(name="maclaurin", native_fused=True, feature_dtype=feature_dtype),
        head_dim=32, num_heads=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(8)
    q0, k0, v0 = (torch.randn(2, 2, 90, 32, generator=g) for _ in "qkv")
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[1, 50:] = False
    pad = ~mask[:, None, :, None]
    results = []
    for k_pad in (torch.zeros_like(k0), 30.0 * torch.randn(k0.shape, generator=g)):
        q, v = q0.clone().requires_grad_(), v0.clone().requires_grad_()
        k = torch.where(pad, k_pad, k0).requires_grad_()
        with _Inputs("masked_fill") as masked:
            out = attn(q, k, v, key_padding_mask=mask, causal=causal)
        # One masking of a key-sized tensor: [v, 1]'s rows (in place, after v's
        # concatenation), none of k (the causal chunks mask their own weights besides).
        keyed = [t for t in masked.inputs if t.shape[-2] == 90]
        assert [t.shape[-1] for t in keyed] == [33] and not any(t is k for t in keyed)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
        assert not k.grad[pad.expand_as(k)].any()
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bf16_autocast_computes_in_float32():
    """Under bf16 autocast the attention computes in float32 (attend_now casts up), so the
    fused kernel serves it and ``feature_dtype`` does not apply: the same bits as float32
    inputs cast from the same bfloat16 values."""
    attn = build_attention(
        dict(name="maclaurin", feature_dtype="bfloat16", native_fused=True),
        head_dim=16, num_heads=2,
    )  # fmt: skip
    q, k, v = (torch.randn(1, 2, 40, 16).bfloat16() for _ in "qkv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = attn(q, k, v)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, attn(q.float(), k.float(), v.float()).bfloat16())


def test_float64_takes_the_unfused_products():
    spec = dict(name="maclaurin", native_fused=True)
    attn = build_attention(spec, head_dim=16, num_heads=1).double()
    ref = build_attention("maclaurin", head_dim=16, num_heads=1).double()
    q, k, v = (torch.randn(1, 1, 20, 16, dtype=torch.float64) for _ in "qkv")
    assert torch.equal(attn(q, k, v), ref(q, k, v))
