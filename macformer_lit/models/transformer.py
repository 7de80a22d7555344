"""Pre-LN Transformer building blocks with a pluggable attention backend.

The multi-head layer owns the q/k/v/o projections and head splitting; the backend only
maps ``(q, k, v, masks)`` to the output (x-transformers ``Attention`` vs ``Attend``).
Blocks follow the pre-LN layout of nanoGPT ``Block`` and the Skyformer/LRA encoder.
Dimension order everywhere: ``(batch, heads, seq, head_dim)``.
"""

from __future__ import annotations

import torch
from torch import nn

from macformer_lit.attention import AttentionSpec, ParsedSpec, build_attention, parse_spec
from macformer_lit.attention.prefix import check_prefix_layers
from macformer_lit.models.dropout import Dropout


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        attention: AttentionSpec | ParsedSpec = None,
        causal_queries: bool = False,
        role: str = "encoder",
        layer: int | None = None,
    ) -> None:
        """``attention`` (a spec or its ``ParsedSpec``) is passed to ``build_attention``;
        ``causal_queries``: the queries are causal although the call is not (decoder
        cross-attention); ``role`` and ``layer``: where the model builds it (an encoder's
        ``prefix`` reads them)."""
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.backend = build_attention(
            attention,
            head_dim=self.head_dim,
            num_heads=num_heads,
            causal_queries=causal_queries,
            role=role,
            layer=layer,
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, d)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        B, H, N, d = x.shape
        return x.transpose(1, 2).reshape(B, N, H * d)  # (B, N, H*d)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        query_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Self-attention over ``x`` (B, N, C), or cross-attention to ``context`` (B, M, C).

        ``query_padding_mask`` (B, N) marks the real queries (pre-SBN keeps padded ones out
        of its statistics); in self-attention it defaults to ``key_padding_mask``.
        """
        if context is None:
            context = x
            if query_padding_mask is None:
                query_padding_mask = key_padding_mask
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(context))
        v = self._heads(self.v_proj(context))
        out = self.backend(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask,
            causal=causal,
        )
        return self.out_proj(self._merge(out))

    def step(
        self, x: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Causal self-attention for the newest position ``x`` (B, 1, C) during decoding."""
        q, k, v = (self._heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        out, state = self.backend.step(q, k, v, state)
        return self.out_proj(self._merge(out)), state


class FeedForward(nn.Module):
    def __init__(self, *, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_model, ffn_dim),
            nn.GELU(),
            Dropout(dropout),
            nn.Linear(ffn_dim, d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EncoderBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        ffn_dim: int,
        dropout: float,
        attention: AttentionSpec | ParsedSpec = None,
        layer: int | None = None,
    ) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(
            d_model=d_model, num_heads=num_heads, attention=attention, layer=layer
        )
        self.ln_ffn = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x), key_padding_mask=padding_mask))
        return x + self.dropout(self.ffn(self.ln_ffn(x)))


class Encoder(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm.

    With ``cls_token=True`` a learned vector is prepended (position 0), so the model
    holds ``max_len + 1`` positions.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_len: int,
        pad_id: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        ffn_dim: int,
        dropout: float,
        attention: AttentionSpec | ParsedSpec = None,
        cls_token: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("max_len", max_len),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
            ("ffn_dim", ffn_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive; got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        if not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {vocab_size})")
        # Parsed once for every layer (a ParsedSpec from the task comes back as it is).
        spec = parse_spec(attention, check_types=False)
        check_prefix_layers(spec.prefix, num_layers)
        self.max_len = max_len
        # No padding_idx: padded positions are masked out of attention and pooling anyway,
        # and for pixel tasks (Image, Pathfinder) id 0 is a real pixel value, not padding.
        self.token_emb = nn.Embedding(vocab_size, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model)) if cls_token else None
        self.pos_emb = nn.Embedding(max_len + int(cls_token), d_model)
        self.dropout = Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(
                d_model=d_model,
                num_heads=num_heads,
                ffn_dim=ffn_dim,
                dropout=dropout,
                attention=spec,
                layer=i,
            )
            for i in range(num_layers)
        )
        self.ln_out = nn.LayerNorm(d_model)

    def forward(
        self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_ids`` (B, N) → hidden states (B, N[+1], C) and the matching mask."""
        B, N = input_ids.shape
        if N > self.max_len:
            raise ValueError(
                f"sequence of length {N} is longer than the model's max_len={self.max_len}; "
                "truncate it in the data or build the model with a larger max_len"
            )
        x = self.token_emb(input_ids)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(B, 1, -1), x], dim=1)
            if padding_mask is not None:
                real = torch.ones(B, 1, dtype=torch.bool, device=padding_mask.device)
                padding_mask = torch.cat([real, padding_mask], dim=1)
        positions = torch.arange(x.shape[1], device=x.device)
        x = self.dropout(x + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x, padding_mask)
        return self.ln_out(x), padding_mask
