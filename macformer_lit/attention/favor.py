"""FAVOR+ (Performer, Choromanski et al. 2021), docs/maths.md §6.

Positive orthogonal random features for the softmax kernel,
φ(x) = m^{-1/2} exp(Wx − ‖x‖²/2) with x = q/d^{1/4}; rows of W orthogonal in blocks of d,
norms χ_d (``row_norm: chi``) or √d (``row_norm: sqrt``), as in performer-pytorch's
``gaussian_orthogonal_random_matrix``. Stabilisers as in Performer: queries subtract their
own row max (their ‖q‖²/2 term is a row constant and cancels too); keys subtract one
maximum per (batch, head), tracked as a running maximum while decoding. Neither changes the
output. W is a buffer, redrawn like RMF's draw.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from .feature_attention import (
    FeatureAttention,
    KeyFeatures,
    QueryFeatures,
    per_head,
)
from .features import sample_orthogonal_gaussian


class FavorAttention(FeatureAttention):
    random_features = True

    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        num_features: int = 128,
        row_norm: Literal["chi", "sqrt"] = "chi",
        **common: Any,
    ) -> None:
        super().__init__(head_dim=head_dim, num_heads=num_heads, **common)
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1; got {num_features}")
        if row_norm not in ("chi", "sqrt"):
            raise ValueError(f"row_norm must be 'chi' or 'sqrt'; got {row_norm!r}")
        self.num_features, self.row_norm = num_features, row_norm
        self.register_buffer("weight", torch.zeros(num_features, head_dim))
        self.register_buffer("redraw_index", torch.zeros((), dtype=torch.long))
        self._draw(None)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, row_norm={self.row_norm}"

    def _draw(self, generator):
        w = sample_orthogonal_gaussian(
            self.num_features, self.head_dim, row_norm=self.row_norm, generator=generator
        )
        self._set_buffer("weight", w)

    def _project(self, x):
        w = self.weight.to(x.dtype) * self.head_dim**-0.25
        return torch.matmul(w, x.transpose(-1, -2))  # (B, H, ..., m, L)

    def _key_features(self, k, keep, floor):
        half_sq = (k * k).sum(-1).unsqueeze(-2) * (0.5 / math.sqrt(self.head_dim))  # (.., 1, L)
        h = self._project(k) - half_sq
        with torch.no_grad():
            top = (h if keep is None else h.masked_fill(~keep, -torch.inf)).flatten(2).amax(-1)
            ref = per_head(torch.where(top.isfinite(), top, 0.0), h)  # 0 if no real key
            if floor is not None:
                ref = torch.maximum(ref, floor)
        h = h - (ref + 0.5 * math.log(self.num_features))
        if keep is not None:
            # Zeroed padded keys sit at h = -ref, which may overflow: send them to exp(-inf) = 0.
            h = h.masked_fill(~keep, -torch.inf)
        return KeyFeatures(h.exp(), ref)

    def _query_features(self, q, ref):
        proj = self._project(q)
        stab = proj.detach().amax(dim=-2, keepdim=True)  # (B, H, 1, N)
        return QueryFeatures((proj - (stab + 0.5 * math.log(self.num_features))).exp(), None)

    def _rescale_state(self, ref_old, ref_new):
        return (ref_old - ref_new).exp()

    def reference_features(self, q, k, key_padding_mask):
        """φ(x) = m^{-1/2} exp(Wx − ‖x‖²/2), x = q/d^{1/4}, with no stabiliser."""
        w = self.weight.double()

        def phi(x):
            x = x.double() * self.head_dim**-0.25
            return torch.exp(x @ w.T - x.pow(2).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])

        return phi(q), phi(k)
