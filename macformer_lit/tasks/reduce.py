"""Stage losses logged as exact means: the training loss over the whole global batch (not
rank 0's share), evaluation losses as weighted torchmetrics means summed over ranks.

Under DDP each rank's loss is the mean over its own slice of the batch. ``global_mean``
sums ``loss x weight`` and ``weight`` over ranks (one 2-element all-reduce a step, beside
the gradients' all-reduce) and divides, so ``train/loss`` is the weighted mean over every
example (or token) that took part in the step, the number one process with the whole
batch would log. Under one process it is the loss itself and communicates nothing.
"""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import MeanMetric


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


def eval_mean_losses() -> torch.nn.ModuleDict:
    """The ``mean_loss`` a module that calls ``log_stage_loss`` holds: a MeanMetric per
    evaluation stage (``val_loss``, ``test_loss``: nn.Module reserves the key "train")."""
    return torch.nn.ModuleDict({f"{s}_loss": MeanMetric() for s in ("val", "test")})


def log_stage_loss(module: L.LightningModule, stage: str, loss: torch.Tensor, weight: int) -> None:
    """Log ``stage/loss``, weighted by ``weight`` (examples or tokens): in training the
    global-batch mean of this step (``global_mean``); in evaluation through the module's
    ``mean_loss[f"{stage}_loss"]`` MeanMetric, whose sums cover every rank exactly once
    (Lightning's own ``sync_dist`` mean divides an all-reduced integer weight by the world
    size, which truncates when ranks saw different numbers of examples)."""
    if stage == "train":
        shown, total = global_mean(module, loss, weight)
        module.log("train/loss", shown, on_epoch=True, prog_bar=True, batch_size=total)
        return
    mean_loss = module.mean_loss[f"{stage}_loss"]
    mean_loss.update(loss.detach(), weight=weight)
    module.log(f"{stage}/loss", mean_loss, on_epoch=True, prog_bar=True, batch_size=weight)
