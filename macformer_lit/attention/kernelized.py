"""Exact kernelized attention for any dot-product kernel (docs/maths.md §3), O(N·M) memory.

    out_i = Σ_j 𝒦(q_i·k_j/√d) v_j / Σ_j 𝒦(q_i·k_j/√d)

The ground truth RMFA approximates, and a backend of its own for short sequences. exp and
trigh (the same kernel) subtract the row maximum first, which cancels in the ratio; the
other kernels have no such identity and are used inside their domain (pre-SBN).
"""

from __future__ import annotations

import math

import torch

from .base import AttentionBackend
from .kernels import get_kernel
from .reference import keep_mask, kernelized_attention


class KernelizedAttention(AttentionBackend):
    def __init__(
        self, *, head_dim: int, num_heads: int, kernel: str = "exp", bounded_inputs: bool = False
    ) -> None:
        super().__init__()
        self.kernel = get_kernel(kernel, bounded_inputs=bounded_inputs)
        self.head_dim, self.num_heads, self.target_kernel = head_dim, num_heads, kernel

    def extra_repr(self) -> str:
        return f"kernel={self.kernel.name}"

    def _attend(self, q, k, v, *, key_padding_mask, causal):
        dtype = q.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(ct), k.to(ct), v.to(ct)
            logits = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, N, M)
            keep = keep_mask(q, k, key_padding_mask, causal)
            if self.kernel.name in ("exp", "trigh"):
                logits = logits.masked_fill(~keep, -torch.inf)
                top = logits.detach().amax(-1, keepdim=True)
                weights = (logits - torch.where(top.isfinite(), top, 0.0)).exp()
            else:
                # Masked logits go to 0 (inside every domain) before the kernel, then drop out.
                weights = self.kernel.exact(logits.masked_fill(~keep, 0.0)).masked_fill(~keep, 0.0)
            den = weights.sum(-1, keepdim=True)
            out = (weights @ v) / den.clamp_min(torch.finfo(den.dtype).tiny)
        return out.to(dtype)

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False):
        return kernelized_attention(q, k, v, self.kernel, key_padding_mask, causal)
