"""Random Maclaurin Feature Attention (Macformer; Kar & Karnick 2012), docs/maths.md §5.

One draw (degrees and Rademacher ω) shared by q and k, kept in buffers. Measures:
``faithful`` (Macformer: every degree sampled, the degree-0 constants merged into one row),
``official`` (the SchoenbAt release / dp-rfs: constant term exact, degrees ≥ 1 sampled) and
``h01`` (Wacker et al.: degree-0 and degree-1 terms exact, degrees ≥ 2 sampled).
``num_features`` counts the sampled features; the exact rows come on top.

Range: q and k are divided by their largest norm R (per batch and head) before the map and
the factor (R_q R_k / √d)^N is given back per feature on the query side, with a per-head
constant removed; the output is unchanged (exactly, in exact arithmetic) but the products
cannot overflow even for |q| ~ 1e4.
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
from .features import MIN_DEGREE, MaclaurinMap, maclaurin_layout, sample_maclaurin
from .kernels import get_kernel
from .reference import rmf_features


class RMFAttention(FeatureAttention):
    signed_features = True
    random_features = True
    resizable_buffers = ("degrees", "omega")

    def __init__(
        self,
        *,
        head_dim: int,
        num_heads: int,
        kernel: str = "exp",
        num_features: int = 128,
        p: float = 2.0,
        measure: Literal["faithful", "official", "h01"] = "faithful",
        bounded_inputs: bool = False,
        **common: Any,
    ) -> None:
        super().__init__(head_dim=head_dim, num_heads=num_heads, **common)
        self.kernel = get_kernel(kernel, bounded_inputs=bounded_inputs)
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1; got {num_features}")
        if not p > 1.0:
            raise ValueError(f"p must be > 1 (P[N = n] ∝ p^-n); got {p}")
        if measure not in MIN_DEGREE:
            raise ValueError(f"unknown measure {measure!r}; valid: {', '.join(MIN_DEGREE)}")
        self.target_kernel = kernel
        self.num_features, self.p, self.measure = num_features, p, measure
        self.register_buffer("degrees", torch.zeros(0, dtype=torch.long))
        self.register_buffer("omega", torch.zeros(head_dim, 0))
        self.register_buffer("redraw_index", torch.zeros((), dtype=torch.long))
        self._draw(None)

    def extra_repr(self) -> str:
        return (
            f"kernel={self.kernel.name}, num_features={self.num_features}, p={self.p}, "
            f"measure={self.measure}, denominator={self.denominator}"
        )

    def _draw(self, generator):
        degrees, omega = sample_maclaurin(
            self.num_features, self.head_dim, p=self.p, measure=self.measure, generator=generator
        )
        self._set_buffer("degrees", degrees)
        self._set_buffer("omega", omega)
        self._refresh()

    def _refresh(self):
        lay = maclaurin_layout(
            self.kernel, self.degrees.cpu(), self.omega.cpu(), p=self.p, measure=self.measure
        )
        self.blocks, self.const, self.max_degree = lay.blocks, lay.const, lay.max_degree
        dtype, device = self.omega.dtype, self.omega.device
        for name in ("omega", "first_degree", "is_first", "row_degree"):
            value = getattr(lay, name).to(device=device, dtype=dtype)
            self.register_buffer(f"_{name}", value, persistent=False)

    def _map(self, x, log_row_scale, log_const):
        """Φ rows of x with ω rows scaled by exp(log_row_scale) (B, H, ..., S, 1)."""
        omega = self._omega.to(x.dtype) * log_row_scale.exp()
        const = None if self.const == 0.0 else self.const * log_const.exp()
        return MaclaurinMap.apply(x, omega, const, self.blocks)

    @staticmethod
    def _log_max_norm(x):
        """log max_i ‖x_i‖ per (batch, head), shaped to broadcast against x."""
        with torch.no_grad():
            top = torch.linalg.vector_norm(x, dim=-1).flatten(2).amax(-1)  # (B, H)
            return per_head(top.clamp_min(1e-6).log(), x)

    def _key_features(self, k, keep, floor):
        # Padded keys are zero rows here, so they never set the range.
        ref = self._log_max_norm(k)
        if floor is not None:
            ref = torch.maximum(ref, floor)
        return KeyFeatures(self._map(k, -ref, torch.zeros_like(ref)), ref)

    def _query_features(self, q, ref):
        log_rq = self._log_max_norm(q)
        s = log_rq + ref - 0.5 * math.log(self.head_dim)  # log(R_q R_k / √d)
        # Per-head constant keeping every query row ≤ its unscaled size; cancels in the ratio.
        log_kappa = -(self.max_degree * s).clamp_min(0.0)
        first = self._first_degree.to(q.dtype)[:, None]
        is_first = self._is_first.to(q.dtype)[:, None]
        log_rows = first * s + is_first * log_kappa - log_rq  # (B, H, ..., S, 1)
        return QueryFeatures(self._map(q, log_rows, log_kappa), log_kappa.exp())

    def _rescale_state(self, ref_old, ref_new):
        return ((ref_old - ref_new) * self._row_degree.to(ref_new.dtype)[:, None]).exp()

    def reference_features(self, q, k, key_padding_mask):
        """Φ one feature at a time from the draw, no range scaling (reference.rmf_features)."""
        s = self.head_dim**-0.25
        return rmf_features(self, q.double() * s), rmf_features(self, k.double() * s)
