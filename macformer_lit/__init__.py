"""macformer_lit: Lightning Transformers with random-feature attention.

Macformer's Random Maclaurin Feature Attention (RMFA) with pre-post Scaling Batch
Normalization (ppSBN), SchoenbAt, Performer's FAVOR+ and exact softmax behind one
attention contract (``macformer_lit.attention``).

The attention as a library, in plain PyTorch (none of these imports lightning; README
"Use the attention in your own model"):

- ``MultiHeadAttention(d_model=, num_heads=, attention={"name": "rmfa", ...})``: drop-in
  multi-head attention on ``x`` (B, N, d_model), ``forward(x, context=None, *,
  key_padding_mask=None, query_padding_mask=None, causal=False)`` with masks (B, N) bool,
  True = real token; ``step(x, state)`` decodes one position.
- ``build_attention(name, *, head_dim, num_heads, pre_sbn=False, post_sbn=False,
  **options)``: a bare backend, ``backend(q, k, v, *, key_padding_mask=None,
  causal=False, query_padding_mask=None)`` on (B, H, N, d) tensors; ``BACKENDS`` names
  them, ``AttentionBackend`` is their base class.
- ``attention_cores(model)``, ``random_feature_backends(model)``: the innermost backends
  of any ``nn.Module`` (inside ppSBN) and those with random features;
  ``backend.redraw_features(seed=, layer=, index=)`` redraws one (what the ``FeatureRedraw``
  callback does).
- ``kernelized_attention(q, k, v, kernel, key_padding_mask, causal)`` (exact, float64),
  ``uniform_attention`` (its baseline) and ``nmse(approx, exact)``: the approximation error
  the ``AttentionTelemetry`` callback logs (docs/maths.md §13).

They load on first access, so ``import macformer_lit`` stays cheap (it imports no torch).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module it lives in, imported on first access (torch takes seconds; even
# ``typing`` would double the import time of this module)
_LAZY = {
    "MultiHeadAttention": "macformer_lit.models.transformer",
    "build_attention": "macformer_lit.attention",
    "BACKENDS": "macformer_lit.attention",
    "AttentionBackend": "macformer_lit.attention",
    "attention_cores": "macformer_lit.attention",
    "random_feature_backends": "macformer_lit.attention",
    "kernelized_attention": "macformer_lit.attention.reference",
    "uniform_attention": "macformer_lit.attention.reference",
    "nmse": "macformer_lit.attention.reference",
}

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "MultiHeadAttention",
    "attention_cores",
    "build_attention",
    "kernelized_attention",
    "nmse",
    "random_feature_backends",
    "uniform_attention",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
