"""Bad configurations and calls fail early with a message that says what to do."""

from __future__ import annotations

import pytest
import torch

from macformer_lit.attention import BACKENDS, build_attention


def _build(name="rmfa", **options):
    return build_attention(name, head_dim=8, num_heads=2, **options)


@pytest.mark.parametrize(
    "name,options,match",
    [
        (
            "nope",
            {},
            "valid backends: favor, kernelized, linear, maclaurin, rmfa, softmax, uniform",
        ),
        ("rmfa", {"kernel": "cosine"}, "valid kernels: exp, inv, log, sqrt, trigh"),
        ("kernelized", {"kernel": "cosine"}, "valid kernels"),
        ("rmfa", {"num_features": 0}, "num_features must be >= 1"),
        ("favor", {"num_features": -3}, "num_features must be >= 1"),
        ("rmfa", {"p": 1.0}, "p must be > 1"),
        ("rmfa", {"measure": "magic"}, "valid: faithful, official, h01"),
        ("rmfa", {"denominator": "clip"}, "valid: fallback, clamp, abs, none"),
        ("rmfa", {"kernel": "inv"}, "enable pre_sbn: true"),
        ("rmfa", {"kernel": "log"}, "enable pre_sbn: true"),
        ("kernelized", {"kernel": "sqrt"}, "enable pre_sbn: true"),
        ("rmfa", {"num_feature": 64}, "no option.*num_feature.*options are:.*num_features"),
        ("softmax", {"sbn_eps": 1e-5}, "set pre_sbn: true"),
        ("softmax", {"temperature_max": 2.0, "post_sbn": True}, "set pre_sbn: true"),
        ("softmax", {"pre_sbn": True, "temperature_max": 0.5}, "temperature_max must be > 1"),
        ("softmax", {"pre_sbn": True, "sbn_stats": "layer"}, "sbn_stats"),
        ("favor", {"row_norm": "unit"}, "row_norm"),
        ("linear", {"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_construction(name, options, match):
    with pytest.raises(ValueError, match=match):
        _build(name, **options)


def test_restricted_kernels_build_with_pre_sbn_or_an_explicit_opt_out():
    for kernel in ("inv", "log", "sqrt"):
        _build(kernel=kernel, pre_sbn=True)
        _build("kernelized", kernel=kernel, bounded_inputs=True)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(
    "shapes,kwargs,match",
    [
        (((2, 2, 5, 8), (2, 2, 5, 8), (2, 2, 4, 8)), {}, "must share"),
        (((2, 2, 5, 8), (2, 2, 5, 4), (2, 2, 5, 8)), {}, "head_dim"),
        (((2, 3, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {}, "batch, heads"),
        (((2, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {}, "shape \\(batch, heads, seq, head_dim\\)"),
        (((2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {"causal": True}, "causal.*N=4, M=5"),
        (((2, 2, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {"key_padding_mask": (2, 4)}, "\\(2, 5\\)"),
        (((2, 2, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {"query_padding_mask": (1, 5)}, "\\(2, 5\\)"),
    ],
)
def test_bad_calls(name, shapes, kwargs, match):
    attn = _build(name)
    q, k, v = (torch.randn(s) for s in shapes)
    kwargs = {
        key: torch.ones(value, dtype=torch.bool) if key.endswith("mask") else value
        for key, value in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        attn(q, k, v, **kwargs)


def test_mask_must_be_bool():
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="bool with True = real token"):
        _build()(q, q, q, key_padding_mask=torch.ones(2, 5))
