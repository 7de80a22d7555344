"""The one attention contract every backend follows (docs/maths.md §1).

    out = attn(q, k, v, *, key_padding_mask=None, causal=False)   # (B, H, N, d)

q is (B, H, N, d), k and v are (B, H, M, d); ``key_padding_mask`` is (B, M) bool with
True = real token. ``causal=True`` requires N == M. A padded key changes nothing at real
query positions. ``query_padding_mask`` (B, N), optional, says which queries are real: only
pre-SBN uses it (its statistics skip padded queries); for self-attention pass the same mask
as ``key_padding_mask``. Outputs at padded query positions are unspecified. Projections and
head splitting live in the model (``macformer_lit.models.transformer.MultiHeadAttention``),
never in a backend.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from .kernels import Kernel


class AttentionBackend(nn.Module):
    """Base class: subclasses implement ``_attend`` on validated inputs, and ``reference``.

    The whole protocol a backend may take part in, declared here:

    - ``__init__(self, *, head_dim, num_heads, **options)``: keyword-only, every option typed
      with a default. The signature is the declaration of the backend's spec options
      (``attention.spec`` reads it for the CLI's checks and ``--help``): nothing else lists
      them. Options a base class shares (FeatureAttention's denominator, chunk and
      recompute options) stay in the base's signature: the subclass ends in ``**common``
      and hands them on, and ``attention.spec`` follows that to the base.
    - ``_attend(q, k, v, *, key_padding_mask, causal)``: the computation.
    - ``reference(q, k, v, *, key_padding_mask, causal)``: a slow, obviously correct float64
      version for the contract tests, from the pure functions of ``attention/reference.py``.
      ``FeatureAttention`` derives it from the feature maps; other backends write it beside
      ``_attend``. A module whose ``reference`` also takes ``query_padding_mask`` (ppSBN)
      sets ``reads_query_mask``.
    - ``step``: one causal decoding step (a key/value cache by default).
    - ``target_kernel``: the exact kernelized attention the backend stands for (telemetry
      measures its error against it).
    - ``own_kernel``: where the backend computes another kernel exactly than the one it
      stands for (deterministic features of a truncated series), that kernel; telemetry
      measures the error against it too. None: the same as ``target_kernel``.
    - ``kernel_inputs(q, k)``: the q and k whose scaled dot products the kernel takes, where
      the backend maps them first (the Maclaurin backend's ``input_map``); telemetry
      measures against the exact attention of these. The inputs themselves by default.
    - ``collect_stats`` / ``last_stats``: while ``collect_stats`` is on, a forward call may
      record statistics of itself in ``last_stats``; callers use ``forward_with_stats``.
    - ``diagnose``: forensics of one forward after a non-finite value (NaNGuard); ``{}``
      where a backend has none.
    """

    target_kernel: str = "exp"
    own_kernel: Kernel | None = None
    random_features: ClassVar[bool] = False
    reads_query_mask: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.collect_stats = False
        self.last_stats: dict[str, torch.Tensor] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        query_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_inputs(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            causal=causal,
            query_padding_mask=query_padding_mask,
        )
        return self._attend(q, k, v, key_padding_mask=key_padding_mask, causal=causal)

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One causal decoding step: q, k, v are (B, H, 1, d) for the newest position.

        ``state`` is None at the first step; the returned state goes into the next call.
        The output equals row t of the full causal pass. This default keeps a key/value
        cache (O(t) per step); backends with a recurrent state override it with an O(1)
        update.
        """
        if state is not None:
            k = torch.cat([state["k"], k], dim=2)
            v = torch.cat([state["v"], v], dim=2)
        out = self._attend(q, k, v, key_padding_mask=None, causal=False)
        return out, {"k": k, "v": v}

    def kernel_inputs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) as the kernel sees them: unchanged unless the backend maps them first."""
        return q, k

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        raise NotImplementedError

    def reference(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """The same attention computed slowly and plainly in float64 (dense (N, M) matrices,
        no stabilisers, no chunking), for tests; see ``attention/reference.py``."""
        raise NotImplementedError(
            f"{type(self).__name__} has no reference(): write its slow float64 version beside "
            "_attend (or subclass FeatureAttention, which derives it from the feature maps)"
        )

    def forward_with_stats(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``forward`` plus the statistics the backend records of the call (``{}`` if it
        records none), e.g. ``denominator_engaged`` for the feature-map backends."""
        collecting = self.collect_stats
        self.collect_stats, self.last_stats = True, {}
        try:
            out = self(q, k, v, key_padding_mask=key_padding_mask, causal=causal)
            return out, dict(self.last_stats)
        finally:
            self.collect_stats = collecting

    @torch.no_grad()
    def diagnose(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> dict[str, float]:
        """Forensics of one forward on these inputs, called after a non-finite loss or
        gradient; ``{}`` for a backend with nothing to add to the input ranges."""
        return {}


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    query_padding_mask: torch.Tensor | None = None,
) -> None:
    """Reject malformed calls with a message instead of an error deep in a matmul."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"attention expects {name} of shape (batch, heads, seq, head_dim); "
                f"got {tuple(t.shape)}"
            )
    if k.shape != v.shape[:3] + (k.shape[-1],) or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (B, H, M)")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, heads and head_dim"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal attention needs as many queries as keys; got N={q.shape[2]}, "
            f"M={k.shape[2]} (use causal=False for cross-attention)"
        )
    for name, mask, L in (
        ("key_padding_mask", key_padding_mask, k.shape[2]),
        ("query_padding_mask", query_padding_mask, q.shape[2]),
    ):
        if mask is None:
            continue
        B = q.shape[0]
        if mask.shape != (B, L):
            raise ValueError(
                f"{name} must be (batch, {name.split('_')[0]}s) = ({B}, {L}); "
                f"got {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"{name} must be bool with True = real token; got {mask.dtype}")
