"""Encoder-decoder Transformer with an attention backend per role; greedy and beam search.

The architecture of Vaswani et al. (2017) in the pre-LN layout of ``transformer.py``, at
the sizes of the bentrevett pytorch-seq2seq tutorial 6 (3+3 layers, hidden 256, 8 heads,
FFN 512). The encoder is ``transformer.Encoder``; decoder blocks add causal self-attention
and cross-attention to the encoder output under the source padding mask. The backend and
its options are chosen separately for encoder self-, decoder self- and cross-attention.

Decoding runs one position at a time: decoder self-attention goes through
``backend.step`` (a key/value cache by default, O(1) per token for backends with a
recurrent state), and the cross-attention keys and values are projected once per
sentence. Beam search follows fairseq's ``SequenceGenerator``: 2k candidates a step,
hypotheses that end in ``</s>`` set aside, a sentence finished once it has k of them,
scores normalised by ``length ** length_penalty``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from macformer_lit.attention import AttentionSpec, ParsedSpec, parse_spec

from .dropout import Dropout
from .transformer import Encoder, FeedForward, MultiHeadAttention

State = dict[str, Any]


class DecoderBlock(nn.Module):
    """Pre-LN: ``x + self_attn(ln(x))``, ``x + cross_attn(ln(x), memory)``, ``x + mlp(ln(x))``."""

    def __init__(
        self,
        *,
        d_model: int,
        num_heads: int,
        ffn_dim: int,
        dropout: float,
        self_attention: AttentionSpec | ParsedSpec = None,
        cross_attention: AttentionSpec | ParsedSpec = None,
    ) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(
            d_model=d_model, num_heads=num_heads, attention=self_attention, role="decoder"
        )
        self.ln_cross = nn.LayerNorm(d_model)
        # Decoder queries are causal although cross-attention is not: pre-SBN must not pool
        # statistics over them in training (ppsbn.PPSBNAttention.leak_free).
        self.cross_attn = MultiHeadAttention(
            d_model=d_model,
            num_heads=num_heads,
            attention=cross_attention,
            causal_queries=True,
            role="cross",
        )
        self.ln_ffn = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        *,
        tgt_padding_mask: torch.Tensor | None = None,
        src_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.ln_self(x), key_padding_mask=tgt_padding_mask, causal=True)
        x = x + self.dropout(h)
        h = self.cross_attn(
            self.ln_cross(x),
            memory,
            key_padding_mask=src_padding_mask,
            query_padding_mask=tgt_padding_mask,
        )
        x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ln_ffn(x)))

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output, (B, H, M, d) each."""
        attn = self.cross_attn
        return attn._heads(attn.k_proj(memory)), attn._heads(attn.v_proj(memory))

    def step(
        self,
        x: torch.Tensor,
        self_state: State | None,
        cross_kv: tuple[torch.Tensor, torch.Tensor],
        src_padding_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, State]:
        """The newest position ``x`` (B, 1, C); equals the matching row of ``forward``."""
        h, self_state = self.self_attn.step(self.ln_self(x), self_state)
        x = x + self.dropout(h)
        attn = self.cross_attn
        q = attn._heads(attn.q_proj(self.ln_cross(x)))  # (B, H, 1, d)
        h = attn.backend(q, *cross_kv, key_padding_mask=src_padding_mask)
        x = x + self.dropout(attn.out_proj(attn._merge(h)))
        return x + self.dropout(self.ffn(self.ln_ffn(x))), self_state


def reorder_state(state: Any, index: torch.Tensor) -> Any:
    """Select batch rows of every tensor in a (nested) decoding state; batch is dim 0."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, index)
    if isinstance(state, dict):
        return {k: reorder_state(v, index) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(reorder_state(v, index) for v in state)
    return state


class Seq2SeqTransformer(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        max_len: int,
        pad_id: int,
        bos_id: int,
        eos_id: int,
        d_model: int = 256,
        num_heads: int = 8,
        num_encoder_layers: int = 3,
        num_decoder_layers: int = 3,
        ffn_dim: int = 512,
        dropout: float = 0.1,
        attention: AttentionSpec = None,
        encoder_attention: AttentionSpec = None,
        decoder_attention: AttentionSpec = None,
        cross_attention: AttentionSpec = None,
        tie_embeddings: bool = True,
        share_embeddings: bool = False,
    ) -> None:
        """
        Args:
            vocab_size, max_len, pad_id, bos_id, eos_id: from the DataModule. ``max_len``
                bounds source and target lengths (positions are learned).
            attention: backend spec ``{name: ..., **options}`` for every role, unless a
                role has its own: ``encoder_attention`` (encoder self-attention),
                ``decoder_attention`` (causal decoder self-attention), ``cross_attention``.
                With ``pre_sbn``, cross-attention normalises its (decoder) queries with
                running statistics in training too (its queries are causal, which
                ``sbn_train_stats: auto`` respects) unless the spec says ``batch``, so no
                target position sees a later one.
            tie_embeddings: the output projection reuses the decoder's token embedding.
            share_embeddings: encoder and decoder share one token embedding (needs one
                vocabulary for both languages, ``shared_vocab`` in the DataModule).
        """
        super().__init__()
        if num_decoder_layers <= 0:
            raise ValueError(f"num_decoder_layers must be positive; got {num_decoder_layers}")
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            if not 0 <= value < vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {vocab_size})")
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(
                f"pad_id, bos_id, eos_id must differ; got {pad_id}, {bos_id}, {eos_id}"
            )
        attention = attention or {"name": "softmax"}
        self.vocab_size, self.max_len = vocab_size, max_len
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.encoder = Encoder(
            vocab_size=vocab_size,
            max_len=max_len,
            pad_id=pad_id,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_encoder_layers,
            ffn_dim=ffn_dim,
            dropout=dropout,
            attention=encoder_attention or attention,
        )
        self.token_emb = (
            self.encoder.token_emb
            if share_embeddings
            else nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        )
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.dropout = Dropout(dropout)
        # Each role's spec parsed once, for all its layers.
        decoder_spec = parse_spec(decoder_attention or attention, check_types=False)
        cross_spec = parse_spec(cross_attention or attention, check_types=False)
        self.blocks = nn.ModuleList(
            DecoderBlock(
                d_model=d_model,
                num_heads=num_heads,
                ffn_dim=ffn_dim,
                dropout=dropout,
                self_attention=decoder_spec,
                cross_attention=cross_spec,
            )
            for _ in range(num_decoder_layers)
        )
        self.ln_out = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        # Tied to an N(0, 1) embedding, the logits would start with std sqrt(d_model) (a
        # loss of ~20 at d = 128): rescale by d_model^-1/2 as T5 does for tied embeddings.
        self.logit_scale = d_model**-0.5 if tie_embeddings else 1.0
        if tie_embeddings:
            self.lm_head.weight = self.token_emb.weight

    # ---- training pass ------------------------------------------------------------------
    def encode(
        self, src_ids: torch.Tensor, src_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, S) source ids → encoder output (B, S, C)."""
        memory, _ = self.encoder(src_ids, src_padding_mask)
        return memory

    def decode(
        self,
        tgt_ids: torch.Tensor,
        memory: torch.Tensor,
        *,
        tgt_padding_mask: torch.Tensor | None = None,
        src_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced decoder input (B, T) → next-token logits (B, T, V)."""
        T = tgt_ids.shape[1]
        if T > self.max_len:
            raise ValueError(f"target of length {T} is longer than max_len={self.max_len}")
        positions = torch.arange(T, device=tgt_ids.device)
        x = self.dropout(self.token_emb(tgt_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(
                x, memory, tgt_padding_mask=tgt_padding_mask, src_padding_mask=src_padding_mask
            )
        return self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and output projection: (..., C) → (..., V)."""
        return self.lm_head(self.ln_out(hidden) * self.logit_scale)

    def forward(
        self,
        src_ids: torch.Tensor,
        src_padding_mask: torch.Tensor | None,
        tgt_ids: torch.Tensor,
        tgt_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        memory = self.encode(src_ids, src_padding_mask)
        return self.decode(
            tgt_ids, memory, tgt_padding_mask=tgt_padding_mask, src_padding_mask=src_padding_mask
        )

    # ---- one position at a time ---------------------------------------------------------
    def start(self, memory: torch.Tensor, src_padding_mask: torch.Tensor | None) -> State:
        """Decoding state before the first token, for the encoder output ``memory``."""
        return {
            "pos": 0,
            "self": [None] * len(self.blocks),
            "cross": [block.project_memory(memory) for block in self.blocks],
            "src_padding_mask": src_padding_mask,
        }

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Feed ``tokens`` (B,) at the next position → logits (B, V) and the new state."""
        pos = state["pos"]
        if pos >= self.max_len:
            raise ValueError(f"decoding past max_len={self.max_len}")
        x = self.token_emb(tokens[:, None]) + self.pos_emb.weight[pos]  # (B, 1, C)
        new_self = []
        for block, self_state, kv in zip(self.blocks, state["self"], state["cross"]):
            x, self_state = block.step(x, self_state, kv, state["src_padding_mask"])
            new_self.append(self_state)
        logits = self.logits(x)[:, 0]
        return logits, {**state, "pos": pos + 1, "self": new_self}

    def _next_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        # Padding and <s> are never generated.
        logits[:, [self.pad_id, self.bos_id]] = float("-inf")
        return logits.log_softmax(-1)

    def _budget(self, max_new_tokens: int | None) -> int:
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive; got {max_new_tokens}")
        return min(max_new_tokens or self.max_len, self.max_len)

    @torch.no_grad()
    def greedy(
        self,
        src_ids: torch.Tensor,
        src_padding_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
    ) -> list[list[int]]:
        """Most probable token at every step; returns ids without ``<s>``/``</s>``."""
        B = src_ids.shape[0]
        memory = self.encode(src_ids, src_padding_mask)
        state = self.start(memory, src_padding_mask)
        tokens = src_ids.new_full((B,), self.bos_id)
        done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
        out = []
        for _ in range(self._budget(max_new_tokens)):
            logits, state = self.step(tokens, state)
            tokens = self._next_logprobs(logits).argmax(-1)
            tokens = tokens.masked_fill(done, self.eos_id)
            out.append(tokens)
            done |= tokens == self.eos_id
            if bool(done.all()):
                break
        return [_until_eos(row, self.eos_id) for row in torch.stack(out, 1).tolist()]

    @torch.no_grad()
    def beam_search(
        self,
        src_ids: torch.Tensor,
        src_padding_mask: torch.Tensor | None = None,
        *,
        beam_size: int = 5,
        max_new_tokens: int | None = None,
        length_penalty: float = 1.0,
    ) -> list[list[int]]:
        """Beam search (fairseq ``SequenceGenerator``); ids without ``<s>``/``</s>``."""
        if beam_size <= 0:
            raise ValueError(f"beam_size must be positive; got {beam_size}")
        B, K, V = src_ids.shape[0], beam_size, self.vocab_size
        memory = self.encode(src_ids, src_padding_mask).repeat_interleave(K, 0)
        mask = None if src_padding_mask is None else src_padding_mask.repeat_interleave(K, 0)
        state = self.start(memory, mask)
        tokens = src_ids.new_full((B * K, 1), self.bos_id)  # (B*K, t+1)
        scores = memory.new_zeros(B, K, dtype=torch.float)
        # All beams start identical: only the first one may expand at step 0.
        scores[:, 1:] = float("-inf")
        offsets = torch.arange(B, device=src_ids.device)[:, None] * K
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        n_cand = min(2 * K, K * V)
        for _ in range(self._budget(max_new_tokens)):
            logits, state = self.step(tokens[:, -1], state)
            cand = scores[:, :, None] + self._next_logprobs(logits).view(B, K, V)
            top_scores, top_idx = cand.view(B, K * V).topk(n_cand, dim=1)
            beam, tok = top_idx // V, top_idx % V
            is_eos = tok == self.eos_id
            # Set aside hypotheses ending in </s> among the best K candidates.
            hits = (is_eos[:, :K] & top_scores[:, :K].isfinite()).nonzero().tolist()
            for b, j in hits:
                if len(finished[b]) < K:
                    row = int(b * K + beam[b, j])
                    seq = tokens[row, 1:].tolist()
                    score = float(top_scores[b, j]) / (len(seq) + 1) ** length_penalty
                    finished[b].append((score, seq))
            if all(len(f) >= K for f in finished):
                break
            # Carry on with the best K candidates that do not end in </s>.
            next_scores, pick = top_scores.masked_fill(is_eos, float("-inf")).topk(K, dim=1)
            reorder = (beam.gather(1, pick) + offsets).view(-1)
            tokens = torch.cat([tokens[reorder], tok.gather(1, pick).view(-1, 1)], dim=1)
            state = {**state, "self": reorder_state(state["self"], reorder)}
            scores = next_scores
        for b in range(B):
            if len(finished[b]) < K:
                # Out of budget: the live beams compete with what has finished.
                for k in range(K):
                    if torch.isfinite(scores[b, k]):
                        seq = tokens[b * K + k, 1:].tolist()
                        finished[b].append((float(scores[b, k]) / len(seq) ** length_penalty, seq))
        return [max(f, key=lambda h: h[0])[1] if f else [] for f in finished]

    def generate(
        self,
        src_ids: torch.Tensor,
        src_padding_mask: torch.Tensor | None = None,
        *,
        beam_size: int = 1,
        max_new_tokens: int | None = None,
        length_penalty: float = 1.0,
    ) -> list[list[int]]:
        """Greedy for ``beam_size=1``, beam search otherwise."""
        if beam_size == 1:
            return self.greedy(src_ids, src_padding_mask, max_new_tokens=max_new_tokens)
        return self.beam_search(
            src_ids,
            src_padding_mask,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            length_penalty=length_penalty,
        )


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids
