"""Prefix attention in an encoder: each position attends to its prefix (or its suffix) only
(docs/maths.md §14, docs/release.md).

    forward:   out_i = attn(q_i, k_{≤i}, v_{≤i})
    backward:  out_i = attn(q_i, k_{≥i}, v_{≥i})   (the causal pass on the reversed sequence)
    split:     heads [0, H/2) forward, heads [H/2, H) backward

The SchoenbAt release's RMFA sums keys with ``torch.cumsum`` inside the LRA encoder, so
every position there attends to its prefix: this wrapper is that mechanism, for any backend
(the core's causal path does the work, chunked for feature backends). ``prefix`` is one
value, or one value per encoder layer (``[forward, none]``); the model supplies the layer.
It is an encoder option: a decoder is causal already, and cross-attention has no order
between queries and keys.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from .base import AttentionBackend
from .reference import reference_forward

Prefix = Literal["none", "forward", "backward", "split"]
PREFIXES: tuple[str, ...] = get_args(Prefix)


def resolve_prefix(prefix: str | list[str] | None, layer: int | None) -> str:
    """The direction for ``layer`` from a spec's ``prefix`` (a value or one per layer);
    ``ValueError`` naming the problem and the valid values."""
    if prefix is None:
        return "none"
    if isinstance(prefix, (list, tuple)):
        bad = [p for p in prefix if p not in PREFIXES]
        if bad or not prefix:
            raise ValueError(
                f"prefix {list(prefix)!r}: each layer's value must be one of {', '.join(PREFIXES)}"
            )
        if layer is None:
            raise ValueError(
                "prefix is a list (one value per encoder layer), but this attention is not "
                "built for an encoder layer; give one value instead"
            )
        if layer >= len(prefix):
            raise ValueError(
                f"prefix lists {len(prefix)} value(s) but the encoder has layer {layer}; "
                "give one value per layer"
            )
        return prefix[layer]
    if prefix not in PREFIXES:
        raise ValueError(f"unknown prefix {prefix!r}; valid: {', '.join(PREFIXES)}")
    return prefix


def _flip(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    return None if t is None else t.flip(dim)


def check_prefix_layers(prefix: str | list[str] | None, num_layers: int) -> None:
    """A per-layer ``prefix`` list must have one value per encoder layer."""
    if isinstance(prefix, (list, tuple)) and len(prefix) != num_layers:
        raise ValueError(
            f"prefix lists {len(prefix)} value(s) for an encoder of {num_layers} layer(s); "
            "give one value per layer, or one value for all"
        )


class PrefixAttention(AttentionBackend):
    """``inner`` called causally in one or both directions over the sequence, as an encoder's
    (non-causal) self-attention. Built by ``build_attention`` where the spec's ``prefix``
    resolves to a direction; ppSBN, where on, wraps this module (its statistics stay
    bidirectional, as in the release, whose pre-SBN standardises each row on its own).
    ``layer`` is the model's to give (the encoder layer, for a per-layer list)."""

    def __init__(
        self,
        inner: AttentionBackend,
        *,
        num_heads: int,
        prefix: Prefix | list[Prefix] = "none",
        layer: int | None = None,
    ) -> None:
        super().__init__()
        direction = resolve_prefix(prefix, layer)
        if direction == "none":
            raise ValueError("PrefixAttention needs a direction: forward, backward or split")
        if direction == "split" and num_heads < 2:
            raise ValueError("prefix: split needs at least 2 heads (half each way); got 1")
        self.inner, self.direction, self.num_heads = inner, direction, num_heads
        self.prefix, self._layer = prefix, layer  # the layer is the model's, not a setting
        self.target_kernel = inner.target_kernel

    @property
    def kernel(self):
        """The core's kernel, where it has one (ppSBN's temperature check reads it)."""
        return getattr(self.inner, "kernel", None)

    def extra_repr(self) -> str:
        return f"direction={self.direction}"

    def _check(self, q, k, causal):
        if causal:
            raise ValueError(
                "prefix attention is an encoder's self-attention: it takes causal=False "
                "(a causal call is a prefix already)"
            )
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"prefix attention needs as many queries as keys (self-attention); got "
                f"N={q.shape[2]}, M={k.shape[2]}"
            )

    def _directions(self, q, k, v, mask, attend):
        """Run ``attend(q, k, v, mask)`` causally per direction and put the heads back."""
        if self.direction == "forward":
            return attend(q, k, v, mask)
        if self.direction == "backward":
            return attend(q.flip(2), k.flip(2), v.flip(2), _flip(mask, 1)).flip(2)
        h = q.shape[1] // 2
        fwd = attend(q[:, :h], k[:, :h], v[:, :h], mask)
        bwd = attend(q[:, h:].flip(2), k[:, h:].flip(2), v[:, h:].flip(2), _flip(mask, 1))
        return torch.cat([fwd, bwd.flip(2)], dim=1)

    def _attend(self, q, k, v, *, key_padding_mask, causal):
        self._check(q, k, causal)
        return self._directions(
            q,
            k,
            v,
            key_padding_mask,
            lambda q, k, v, m: self.inner(q, k, v, key_padding_mask=m, causal=True),
        )

    def reference(self, q, k, v, *, key_padding_mask=None, causal=False):
        self._check(q, k, causal)
        return self._directions(
            q,
            k,
            v,
            key_padding_mask,
            lambda q, k, v, m: reference_forward(
                self.inner, q, k, v, key_padding_mask=m, causal=True
            ),
        )

    def step(self, q, k, v, state=None):
        raise ValueError("prefix attention is an encoder option: it has no decoding step")
