"""Sequence classifiers for Long Range Arena (docs/architecture.md §2).

``EncoderClassifier``: encoder, pooling, MLP head (Skyformer / LRA encoder classifier).
``DualEncoderClassifier``: LRA Retrieval, one shared encoder for both documents and a
head on ``[e1, e2, e1*e2, e1-e2]`` (LRA ``matching`` task).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from macformer_lit.attention import AttentionSpec

from .transformer import Encoder

Pooling = Literal["mean", "cls", "mean_unmasked"]
POOLINGS = ("mean", "cls", "mean_unmasked")


def pool(h: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """(B, N, C) → (B, C). ``mean`` averages real positions only; ``mean_unmasked``
    averages every position, padding included, as Skyformer does."""
    if mode == "cls":
        return h[:, 0]
    if mode == "mean_unmasked" or mask is None:
        return h.mean(dim=1)
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def _check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; valid: {', '.join(POOLINGS)}")


class EncoderClassifier(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        num_classes: int,
        max_len: int,
        pad_id: int,
        d_model: int = 64,
        num_heads: int = 2,
        num_layers: int = 2,
        ffn_dim: int = 128,
        dropout: float = 0.1,
        attention: AttentionSpec = None,
        pooling: Pooling = "mean",
    ) -> None:
        """
        Args:
            vocab_size, num_classes, max_len, pad_id: from the DataModule (the CLI links
                them).
            d_model, num_heads, num_layers, ffn_dim, dropout: the pre-LN encoder's sizes.
            attention: backend spec ``{name: ..., **options}``, see ``configs/attention/``;
                a bare name means ``{name: <name>}``; None is softmax.
            pooling: ``mean`` over real tokens, ``cls`` token, or ``mean_unmasked``
                (Skyformer's mean over every position, padding included).
        """
        super().__init__()
        _check_pooling(pooling)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2; got {num_classes}")
        self.pooling = pooling
        self.encoder = Encoder(
            vocab_size=vocab_size,
            max_len=max_len,
            pad_id=pad_id,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            ffn_dim=ffn_dim,
            dropout=dropout,
            attention=attention,
            cls_token=pooling == "cls",
        )
        self.head = nn.Sequential(
            nn.Linear(d_model, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, num_classes)
        )

    def embed(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        h, mask = self.encoder(input_ids, padding_mask)
        return pool(h, mask, self.pooling)  # (B, C)

    def forward(
        self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.head(self.embed(input_ids, padding_mask))  # (B, num_classes)


class DualEncoderClassifier(EncoderClassifier):
    """Two documents through one shared encoder; the head sees both embeddings."""

    def __init__(self, *, d_model: int = 64, ffn_dim: int = 128, **kwargs: Any) -> None:
        super().__init__(d_model=d_model, ffn_dim=ffn_dim, **kwargs)
        num_classes = self.head[-1].out_features
        self.head = nn.Sequential(
            nn.Linear(4 * d_model, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, num_classes)
        )

    def forward(
        self,
        input_ids_0: torch.Tensor,
        padding_mask_0: torch.Tensor | None,
        input_ids_1: torch.Tensor,
        padding_mask_1: torch.Tensor | None,
    ) -> torch.Tensor:
        e1 = self.embed(input_ids_0, padding_mask_0)
        e2 = self.embed(input_ids_1, padding_mask_1)
        return self.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))
