"""Fixtures for the attention tests; ``backend_case`` is generated from the registry, so a new
backend in ``BACKENDS`` runs every contract test with no new test code."""

from __future__ import annotations

import pytest
import torch

from macformer_lit.attention import BACKENDS, build_attention
from macformer_lit.attention.spec import backend_options

HEAD_DIM, NUM_HEADS = 8, 2


@pytest.fixture(autouse=True)
def _native_cache(tmp_path_factory, monkeypatch):
    """The native kernels (native_map, native_fused) build into a folder of the test session,
    not the user's cache."""
    monkeypatch.setenv("MACFORMER_LIT_CACHE", str(tmp_path_factory.getbasetemp() / "native"))


def small_options(name: str) -> dict:
    """Options that keep tests fast and exercise chunking: few features, tiny chunks."""
    params = backend_options(name)
    options = {}
    if "num_features" in params:
        options["num_features"] = 16
    if "chunk_size" in params:
        options["chunk_size"] = 4
    return options


def pytest_generate_tests(metafunc):
    if "backend_case" in metafunc.fixturenames:
        cases = [(name, sbn) for name in BACKENDS for sbn in (False, True)]
        ids = [f"{name}{'-ppsbn' if sbn else ''}" for name, sbn in cases]
        metafunc.parametrize("backend_case", cases, ids=ids)


@pytest.fixture
def build(backend_case):
    """build(dtype=float64, seed=0, **options) -> the case's backend (ppSBN-wrapped or not)."""
    name, sbn = backend_case

    def make(dtype=torch.float64, seed=0, **options):
        torch.manual_seed(seed)
        spec = {**small_options(name), **options}
        if sbn:
            spec.update(pre_sbn=True, post_sbn=True)
        module = build_attention(name, head_dim=HEAD_DIM, num_heads=NUM_HEADS, **spec)
        if sbn:
            # Move γ, β away from 1 so post-SBN is not the identity under test.
            with torch.no_grad():
                module.gamma.uniform_(0.5, 1.5)
                module.log_beta.uniform_(-0.3, 0.3)
        return module.to(dtype)

    return make


@pytest.fixture
def make_inputs():
    """make_inputs(B, N, M=None, seed=0, scale=0.5, dtype) -> q (B,H,N,d), k, v (B,H,M,d)."""

    def make(B=2, N=11, M=None, seed=0, scale=0.5, dtype=torch.float64):
        g = torch.Generator().manual_seed(seed)
        M = N if M is None else M
        q = torch.randn(B, NUM_HEADS, N, HEAD_DIM, generator=g, dtype=dtype) * scale
        k = torch.randn(B, NUM_HEADS, M, HEAD_DIM, generator=g, dtype=dtype) * scale
        v = torch.randn(B, NUM_HEADS, M, HEAD_DIM, generator=g, dtype=dtype)
        return q, k, v

    return make
