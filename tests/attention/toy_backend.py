"""A backend written the way the README's "How to add a backend" says, for
``test_new_backend.py``: this file is the backend's one file; ``register`` is its one
registry line (``BACKENDS["toy"] = ToyAttention``), and ``TOY_YAML`` its one config.

Loaded as a pytest plugin (``-p toy_backend``) it registers itself before collection, so
the registry-generated contract tests include it; imported, it registers nothing.
"""

from __future__ import annotations

import torch.nn.functional as F

from macformer_lit.attention import BACKENDS
from macformer_lit.attention.feature_attention import (
    Denominator,
    FeatureAttention,
    KeyFeatures,
    QueryFeatures,
)

TOY_YAML = "model:\n  init_args:\n    attention:\n      name: toy\n      chunk_size: 8\n"


class ToyAttention(FeatureAttention):
    """φ(x) = softplus(x): positive deterministic features, nothing else written."""

    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        denominator: Denominator = "fallback",
        denominator_eps: float = 1e-3,
        chunk_size: int = 64,
    ) -> None:
        super().__init__(
            head_dim=head_dim,
            num_heads=num_heads,
            denominator=denominator,
            denominator_eps=denominator_eps,
            chunk_size=chunk_size,
        )

    def _key_features(self, k, keep, floor):
        return KeyFeatures(F.softplus(k).transpose(-1, -2), None)

    def _query_features(self, q, ref):
        return QueryFeatures(F.softplus(q).transpose(-1, -2), None)


def register() -> None:
    BACKENDS["toy"] = ToyAttention


def pytest_configure(config):
    register()
