"""Dropout with cheap masks on the CPU (docs/pitfalls.md §2).

On the CPU, ``torch.nn.Dropout`` draws one Bernoulli variate per element from the mt19937
generator, a large share of a training step (measured in docs/pitfalls.md §2). Here each
64-bit draw gives four 16-bit uniforms, compared with ⌊p·2¹⁶⌉. The drop probability is
therefore p rounded to a multiple of 2⁻¹⁶ (0.1 → 0.100006), and kept values are scaled by
1/(1 − that probability), so the layer stays unbiased. The draws come from torch's default
CPU generator, so ``seed_everything`` and checkpointed RNG states govern them as before. Only
the 1-byte mask is kept for the backward pass. Off the CPU (CUDA's Philox dropout is already
fast), under torch.compile and in eval mode this is ``torch.nn.functional.dropout``.

The masks differ from torch's, so a run's losses depend on which generator drew them:
``set_mask_generator("torch")`` (the CLI's ``--dropout_masks torch``) restores torch's
Bernoulli masks, which every run recorded before this module existed used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LANES = 1 << 16
_I64 = torch.iinfo(torch.int64)
MASK_GENERATORS = ("fast", "torch")
_generator = "fast"


def set_mask_generator(name: str) -> None:
    """Process-wide: ``fast`` (default, above) or ``torch`` (``nn.Dropout``'s masks)."""
    global _generator
    if name not in MASK_GENERATORS:
        raise ValueError(f"unknown dropout mask generator {name!r}; valid: fast, torch")
    _generator = name


def keep_mask(shape: torch.Size, threshold: int, device: torch.device) -> torch.Tensor:
    """Bool mask, True with probability 1 − threshold/2¹⁶, four lanes per 64-bit draw."""
    numel = shape.numel()
    words = torch.empty(-(-numel // 4), dtype=torch.int64, device=device)
    # The full int64 range: random_() alone leaves the top bit 0 (lane 3 biased).
    words.random_(_I64.min, _I64.max)
    lanes = words.view(torch.int16)[:numel]
    return (lanes >= threshold - _LANES // 2).view(shape)


class _MaskedScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return (x * keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return (grad * keep).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    # torch.compile cannot trace ``random_`` into a graph; inductor draws its own masks.
    if x.device.type != "cpu" or p >= 1.0 or _generator == "torch" or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    threshold = round(p * _LANES)
    if threshold == 0:
        return x
    if threshold >= _LANES:  # p within 2^-17 of 1: torch's exact masks and scale
        return F.dropout(x, p, training)
    keep = keep_mask(x.shape, threshold, x.device)
    return _MaskedScale.apply(x, keep, _LANES / (_LANES - threshold))


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the fast CPU mask above (same arguments, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return F.dropout(x, self.p, self.training, inplace=True)
        return dropout(x, self.p, self.training)
