"""Kernels: Maclaurin series vs closed forms, the corrections of docs/maths.md §4, registration."""

from __future__ import annotations

import math

import pytest
import torch

from macformer_lit.attention import KERNELS, build_attention, get_kernel, register_kernel


@pytest.mark.parametrize("name", ["exp", "inv", "log", "trigh", "sqrt"])
def test_series_matches_exact(name):
    kernel = get_kernel(name)
    x = torch.linspace(-0.9, 0.9, 37, dtype=torch.float64)
    series = sum(kernel.coefficient(n) * x**n for n in range(400))
    torch.testing.assert_close(series, kernel.exact(x), rtol=1e-10, atol=1e-10)
    assert all(kernel.coefficient(n) >= 0 for n in range(100))


def test_corrected_coefficients():
    log, sqrt = get_kernel("log"), get_kernel("sqrt")
    assert log.coefficient(0) == 1.0 and log.coefficient(3) == pytest.approx(1 / 3)
    # sqrt: 2 − √(1−x) = 1 + x/2 + x²/8 + x³/16 + 5x⁴/128 + 7x⁵/256 (the paper's table gives
    # 5/384 at N = 4).
    expected = [1, 1 / 2, 1 / 8, 1 / 16, 5 / 128, 7 / 256]
    assert [sqrt.coefficient(n) for n in range(6)] == pytest.approx(expected, rel=1e-12)


def test_trigh_is_exp():
    trigh, exp = get_kernel("trigh"), get_kernel("exp")
    x = torch.linspace(-3, 3, 11, dtype=torch.float64)
    torch.testing.assert_close(trigh.exact(x), exp.exact(x))
    assert [trigh.coefficient(n) for n in range(30)] == [exp.coefficient(n) for n in range(30)]
    q, k, v = torch.randn(3, 1, 2, 7, 8, dtype=torch.float64) * 0.5
    outs = []
    for name in ("exp", "trigh"):
        torch.manual_seed(0)
        outs.append(build_attention("rmfa", head_dim=8, num_heads=2, kernel=name).double()(q, k, v))
    torch.testing.assert_close(outs[0], outs[1])


def test_first_order_truncation():
    x = torch.tensor([0.1, -0.2], dtype=torch.float64)
    torch.testing.assert_close(get_kernel("exp").truncated(x, 1), 1 + x)


BUILTIN_KERNELS = {"exp", "inv", "log", "trigh", "sqrt"}


@pytest.fixture
def scratch_registry():
    """Kernels registered in a test are removed after it (the registry is process-global: a
    leftover name would change the "valid kernels" messages that other tests expect)."""
    saved = dict(KERNELS)
    yield
    KERNELS.clear()
    KERNELS.update(saved)


def test_register_kernel_is_usable_by_backends(scratch_registry):
    name = "test_cosh"
    register_kernel(name, lambda n: 0.0 if n % 2 else math.exp(-math.lgamma(n + 1)), torch.cosh)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 5, 8, generator=g, dtype=torch.float64) * 0.3
    exact = build_attention("kernelized", head_dim=8, num_heads=2, kernel=name)(q, k, v)
    weights = torch.cosh(q @ k.transpose(-1, -2) / math.sqrt(8))
    torch.testing.assert_close(exact, (weights / weights.sum(-1, keepdim=True)) @ v)
    torch.manual_seed(0)
    rmfa = build_attention(
        "rmfa", head_dim=8, num_heads=2, kernel=name, num_features=20000, measure="h01"
    ).double()
    # Measured NMSE 3e-8 to 9e-8 over four seeds; exp's attention in place of cosh's is 3e-3 off.
    assert float((rmfa(q, k, v) - exact).pow(2).mean() / exact.pow(2).mean()) < 1e-6
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(name, lambda n: 1.0, torch.exp)
    with pytest.raises(ValueError, match="negative"):
        register_kernel("test_negative", lambda n: -1.0 if n == 3 else 1.0, torch.exp)
    assert set(KERNELS) == BUILTIN_KERNELS | {name}  # the refused kernel was not registered


def test_registry_holds_only_the_builtin_kernels():
    """Runs after the registration test in this file: its kernel must be gone."""
    assert set(KERNELS) == BUILTIN_KERNELS
