"""Linear attention with φ(x) = elu(x) + 1 (Katharopoulos et al. 2020, "Transformers are
RNNs"; fast-transformers' ``elu_feature_map``), docs/maths.md §7.

Deterministic positive features, no buffers: the cost floor of linear attention. The
telemetry compares it with exact softmax attention (``target_kernel = "exp"``), the
attention it replaces.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from .feature_attention import FeatureAttention, KeyFeatures, QueryFeatures


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
        return KeyFeatures((F.elu(k) + 1.0).transpose(-1, -2), None)

    def _query_features(self, q, ref):
        return QueryFeatures((F.elu(q) + 1.0).transpose(-1, -2), None)
