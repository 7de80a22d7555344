"""Linear attention with φ(x) = elu(x) + 1 (Katharopoulos et al. 2020, "Transformers are
RNNs"; fast-transformers' ``elu_feature_map``), docs/maths.md §7.

Deterministic positive features, no buffers: the cost floor of linear attention. The
telemetry compares it with exact softmax attention (``target_kernel = "exp"``), the
attention it replaces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .feature_attention import FeatureAttention, KeyFeatures, QueryFeatures


def _elu1(x):
    """elu(x) + 1. Compiled, as x + 1 for x > 0 and exp(x) otherwise (inductor fuses it into
    one kernel): AOTAutograd traced ``elu_backward`` with another memory layout than its
    eager kernel returns, and the backward graph's next ``view`` then failed on the causal
    chunked path (tests/attention/test_attention_compile.py). Eager, ``F.elu``: one kernel
    each way. The two differ by rounding (expm1(x) + 1 against exp(x))."""
    if torch.compiler.is_compiling():
        return torch.where(x > 0, x + 1.0, x.clamp_max(0.0).exp())
    return F.elu(x) + 1.0


class LinearAttention(FeatureAttention):
    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        **common: Any,
    ) -> None:
        super().__init__(head_dim=head_dim, num_heads=num_heads, **common)

    def _key_features(self, k, key_padding_mask, floor):
        return KeyFeatures(_elu1(k).transpose(-1, -2), None)

    def _query_features(self, q, ref):
        return QueryFeatures(_elu1(q).transpose(-1, -2), None)
