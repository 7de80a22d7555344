"""The native degree-2 Maclaurin map (attention/native_map.py): the eager map's rows bit for
bit, its gradient within float32's rounding of the exact one, the same bits on any thread
count, the attention it serves equal to the eager map's, and the bad combinations refused."""

from __future__ import annotations

import pytest
import torch
from native_support import CXX, U32, needs_cxx
from native_support import scale as _scale

from macformer_lit.attention import build_attention, native_map
from macformer_lit.attention.maclaurin import maclaurin_rows
from macformer_lit.attention.native_fused import native_fused_products
from macformer_lit.attention.native_map import _library, library, native_maclaurin_rows

pytestmark = needs_cxx


# 8 and 48: the loop for any head size; 16, 32, 64: the compiled-in sizes. Feature-major:
# 37 rows, a block of 32 and a part.
@pytest.mark.parametrize("d", [8, 16, 32, 48, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("feature_major", [False, True], ids=["rows", "feature_major"])
def test_rows_are_the_eager_maps_bit_for_bit(d, dtype, feature_major):
    g = torch.Generator().manual_seed(d)
    # Non-contiguous input; large and tiny entries (bfloat16's rounding at both ends), a NaN.
    x = torch.randn(3, 37, 2, d, generator=g).transpose(1, 2) * 3
    x[0, 0, 0, :2] = torch.tensor([1e-30, 3e20])
    x[2, 1, 5, 3] = float("nan")
    native = native_maclaurin_rows(x, _scale(d), dtype, CXX, feature_major)
    eager = maclaurin_rows(x, _scale(d), 2, dtype)
    assert native.dtype == dtype and native.shape == eager.shape
    assert (native.transpose(-1, -2) if feature_major else native).is_contiguous()
    assert torch.equal(native.isnan(), eager.isnan())
    assert torch.equal(native.nan_to_num(), eager.nan_to_num())


def _feature_major(t):
    """The same values stored (..., D', L) contiguous, as φ(k)ᵀ[v, 1]'s backward leaves them."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("d", [8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["row_major", "feature_major"])
def test_gradient_within_float32_rounding_of_the_exact_one(d, dtype, layout):
    """Each entry of ∂x sums d + 2 terms g'·x̂ (g' = g·s), each from two or three float32
    products, scaled by d^(-1/4): within γ_{2d+8}·Σ|terms| of the float64 gradient of the same
    (rounded) g, in any order of summation. Σ|terms| is that gradient at |x|, |g|. Both
    layouts of g: rows (q's gradient) and features-major (k's, read in place by the kernel
    for blocks of rows; 50 rows: a full block and a part)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 50, d, generator=gen)
    grad = torch.randn(2, 3, 50, 1 + d + d * (d + 1) // 2, generator=gen).to(dtype)
    if layout == "feature_major":
        grad = _feature_major(grad)
    xn = x.clone().requires_grad_()
    (native,) = torch.autograd.grad(native_maclaurin_rows(xn, _scale(d), dtype, CXX), xn, grad)
    x64 = x.double().requires_grad_()
    rows = maclaurin_rows(x64, _scale(d).double(), 2, torch.float64)
    (exact,) = torch.autograd.grad(rows, x64, grad.double())
    xa = x.double().abs().requires_grad_()
    rows = maclaurin_rows(xa, _scale(d).double(), 2, torch.float64)
    (size,) = torch.autograd.grad(rows, xa, grad.double().abs())
    n = 2 * d + 8
    bound = n * U32 / (1 - n * U32) * size
    err = (native.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert err.max() > 0  # float32, not float64: the bound is not met vacuously


@pytest.mark.parametrize("layout", ["row_major", "feature_major"])
def test_same_bits_on_any_thread_count(layout):
    x = torch.randn(4, 2, 301, 32).requires_grad_()
    grad = torch.randn(4, 2, 301, 561).bfloat16()
    if layout == "feature_major":
        grad = _feature_major(grad)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            rows = native_maclaurin_rows(x, _scale(32), torch.bfloat16, CXX)
            (gx,) = torch.autograd.grad(rows, x, grad)
            results.append((rows, gx))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_attention_equals_the_eager_maps(causal):
    """In ppSBN with bfloat16 rows and padding: the forward from the same rows is the same
    bits; the gradients from the two backwards agree to float32 rounding."""
    spec = dict(name="maclaurin", pre_sbn=True, post_sbn=True, temperature_max=32.0,
                feature_dtype="bfloat16")  # fmt: skip
    eager = build_attention(spec, head_dim=32, num_heads=2)
    native = build_attention({**spec, "native_map": True}, head_dim=32, num_heads=2)
    native.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(3)
    q0, k0, v0 = (torch.randn(2, 2, 90, 32, generator=g) for _ in "qkv")
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[1, 60:] = False
    results = []
    for attn in (eager, native):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attn(q, k, v, key_padding_mask=mask, causal=causal)
        (out * mask[:, None, :, None]).square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_float64_takes_the_eager_map():
    attn = build_attention("maclaurin", head_dim=8, num_heads=1, native_map=True).double()
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    assert attn._map(x).dtype == torch.float64


def test_cache_folder(tmp_path, monkeypatch):
    """The library is built into $MACFORMER_LIT_CACHE, one file per source and compiler."""
    monkeypatch.setenv("MACFORMER_LIT_CACHE", str(tmp_path))
    _library.cache_clear()
    try:
        library(CXX)
        built = list(tmp_path.glob("maclaurin_map_*.so"))
        assert len(built) == 1 and built[0].stat().st_size > 0
        assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no build folder left
    finally:
        _library.cache_clear()


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    return {p for p in paths if p.rsplit("/", 1)[-1].startswith(("libgomp", "libomp", "libiomp"))}


@pytest.mark.skipif(
    "parallel backend: OpenMP" not in torch.__config__.parallel_info(),
    reason="torch's threads are not OpenMP's here",
)
def test_threads_are_torchs_openmp_threads():
    """Built with OpenMP (g++ has it), the kernels run on the runtime torch loaded: one
    OpenMP runtime in the process, not a second pool of threads competing for the cores."""
    lib = library(CXX)
    if "g++" in CXX:
        assert lib.maclaurin2_openmp() == 1
    if not lib.maclaurin2_openmp():
        pytest.skip("this compiler built the library without OpenMP")
    rows = native_maclaurin_rows(torch.randn(2, 2, 64, 32), _scale(32), torch.float32, CXX)
    assert rows.shape[-1] == 561
    assert len(_openmp_runtimes()) == 1, _openmp_runtimes()


def test_without_openmp_the_same_bits(tmp_path, monkeypatch):
    """A compiler without OpenMP builds the std::thread variant: the same chunks of rows, so
    the same bits (the map, the fused products and their gradients, on three threads)."""
    monkeypatch.setenv("MACFORMER_LIT_CACHE", str(tmp_path))
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(3, 2, 101, 32, generator=gen), torch.randn(3, 2, 77, 32, generator=gen)
    v1, g = torch.randn(3, 2, 77, 33, generator=gen), torch.randn(3, 2, 101, 33, generator=gen)
    threads, results, builds = torch.get_num_threads(), [], []
    try:
        torch.set_num_threads(3)
        for flags in (native_map.OPENMP, []):
            monkeypatch.setattr(native_map, "OPENMP", flags)
            _library.cache_clear()
            builds.append(library(CXX).maclaurin2_openmp())
            leaves = [t.clone().requires_grad_() for t in (q, k, v1)]
            out = native_fused_products(*leaves, _scale(32), CXX, bf16=False)
            rows = native_maclaurin_rows(q, _scale(32), torch.bfloat16, CXX)
            results.append((rows, out, *torch.autograd.grad(out, leaves, g)))
    finally:
        torch.set_num_threads(threads)
        _library.cache_clear()
    assert builds[1] == 0 and len(list(tmp_path.glob("maclaurin_map_*.so"))) == 2
    for a, b in zip(*results):
        assert torch.equal(a, b)


# The refusals of both native options: native_map (the map) and native_fused (the fused
# products, tests/attention/test_native_fused.py).
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(native_map=True, degree=1), "native_map: true is the degree-2 map's kernel"),
        (dict(native_map=True, head_dim=2048), "native_map: true takes head_dim ≤ 1024"),
        (dict(native_map=True, head_dim=768, input_map="sign_split"),
         "≤ 512 with input_map: sign_split\\); got 1536 map inputs"),
        (dict(native_fused=True, degree=1), "native_fused: true is the degree-2 map's fused"),
        (dict(native_fused=True, head_dim=24),
         "native_fused: true takes head_dim 16, 32, 48, 64; got 24"),
    ],
)  # fmt: skip
def test_bad_combinations_refused(options, message):
    kwargs = dict(head_dim=16, num_heads=1) | options
    with pytest.raises(ValueError, match=message):
        build_attention("maclaurin", **kwargs)


@pytest.mark.parametrize("option", ["native_map", "native_fused"])
def test_needs_a_cxx_compiler(monkeypatch, tmp_path, option):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=f"{option}: true needs a C\\+\\+ compiler"):
        build_attention("maclaurin", head_dim=16, num_heads=2, **{option: True})


def _refused_build(option: str, match: str) -> str:
    """The one-line message of a backend whose library cannot be built; the cache of built
    libraries cleared before and after."""
    _library.cache_clear()
    try:
        with pytest.raises(ValueError, match=match) as err:
            build_attention("maclaurin", head_dim=16, num_heads=1, **{option: True})
    finally:
        _library.cache_clear()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{option}: true: ")
    return message


@pytest.mark.parametrize("option", ["native_map", "native_fused"])
def test_a_compiler_that_fails_is_refused_in_one_line(tmp_path, monkeypatch, option):
    """Checked when the backend is built, before any training."""
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\necho 'fatal error: no such target' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("MACFORMER_LIT_CACHE", str(tmp_path / "cache"))
    assert "no such target" in _refused_build(option, "could not build the kernel")


def test_an_unwritable_cache_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """A cache folder that cannot be made (here: under a plain file) says which and how to
    point elsewhere, before any training."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MACFORMER_LIT_CACHE", str(blocker / "cache"))
    message = _refused_build("native_map", "cannot write the kernel's cache folder")
    assert "MACFORMER_LIT_CACHE" in message
