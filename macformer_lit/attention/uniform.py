"""Uniform attention: every visible key weighted equally (docs/maths.md §14).

    out_i = (1/n_i) Σ_{j visible from i} v_j

The kernel-free control: what every dot-product kernel tends to as q·k/√d → 0, and what a
random-feature estimate must beat to carry information from q and k. Bidirectional, a
mean over the real keys; causal (or with ``prefix``), a running mean. q and k are ignored
(only their shapes are checked); there are no options to give.
"""

from __future__ import annotations

import torch

from .base import AttentionBackend
from .reference import uniform_attention


class _IgnoringQK(torch.autograd.Function):
    """``out`` as it is, with zero gradients for q and k: the projections that make them stay
    in the graph, so DDP (which fails on parameters with no gradient) and the optimiser see
    them as used. Zeros, not an ``0 * q.sum()`` term, which would turn an inf into NaN."""

    @staticmethod
    def forward(ctx, out, q, k):
        ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        (qs, qd, ks, kd) = ctx.shapes
        return g, g.new_zeros(qs, dtype=qd), g.new_zeros(ks, dtype=kd)


class UniformAttention(AttentionBackend):
    def __init__(self, *, head_dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim, self.num_heads = head_dim, num_heads

    def _attend(self, q, k, v, *, key_padding_mask, causal):
        dtype = v.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(v.device.type, enabled=False):
            v = v.to(ct)
            if key_padding_mask is None:
                keep = v.new_ones(1, 1, v.shape[2], 1)
            else:
                keep = key_padding_mask[:, None, :, None].to(ct)
                v = v * keep
            if causal:
                total, count = v.cumsum(2), keep.cumsum(2)
            else:
                total, count = v.sum(2, keepdim=True), keep.sum(2, keepdim=True)
            # A query with no visible key gets 0, as exact attention's masked rows do.
            out = total / count.clamp_min(1.0)
            out = out.expand(*v.shape[:2], q.shape[2], v.shape[-1]).to(dtype)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            out = _IgnoringQK.apply(out, q, k)
        return out

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False):
        out = uniform_attention(q, k, v, key_padding_mask, causal)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            out = _IgnoringQK.apply(out, q, k)
        return out
