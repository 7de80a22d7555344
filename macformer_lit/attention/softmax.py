"""Exact softmax attention through torch SDPA (docs/maths.md §2).

Flash / memory-efficient kernels on GPU, the fused kernel on CPU. Attention dropout is an
explicit option: on CPU any ``dropout > 0`` in training leaves the fused kernel for the
math path, several times slower (docs/pitfalls.md §2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend
from .reference import kernelized_attention


class SoftmaxAttention(AttentionBackend):
    def __init__(self, *, head_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1); got {dropout}")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.dropout = dropout

    def _attend(self, q, k, v, *, key_padding_mask, causal):
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, M)
            if causal:
                N = q.shape[2]
                tril = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
                mask = mask & tril
                causal = False
        dropout_p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )
        if mask is not None:
            # A query whose keys are all padding gets NaN from SDPA; zero it instead.
            out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        return out

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False):
        return kernelized_attention(q, k, v, "exp", key_padding_mask, causal)
