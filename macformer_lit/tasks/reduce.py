"""The training loss as one number for the whole global batch, not rank 0's share.

Under DDP each rank's loss is the mean over its own slice of the batch. ``global_mean``
sums ``loss x weight`` and ``weight`` over ranks (one 2-element all-reduce a step, beside
the gradients' all-reduce) and divides, so ``train/loss`` is the weighted mean over every
example (or token) that took part in the step, the number one process with the whole
batch would log. Under one process it is the loss itself and communicates nothing.
"""

from __future__ import annotations

import lightning as L
import torch


def global_mean(
    module: L.LightningModule, value: torch.Tensor, weight: int
) -> tuple[torch.Tensor, int]:
    """``(weighted mean of value over ranks, total weight)``; the value itself on one rank."""
    value = value.detach()
    trainer = module._trainer
    if trainer is None or trainer.world_size == 1:
        return value, weight
    stats = torch.stack([value.float() * weight, torch.tensor(float(weight), device=value.device)])
    stats = trainer.strategy.reduce(stats, reduce_op="sum")
    total = float(stats[1])
    return stats[0] / max(total, 1.0), max(int(round(total)), 1)
