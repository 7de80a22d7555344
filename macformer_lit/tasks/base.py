"""What LitClassifier and LitTranslator share: the stages, the step methods around one
``_shared_step(batch, stage)``, how a stage metric is logged, and the optimiser."""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import Metric

from .compat import CheckpointCompatibility
from .optim import adamw_warmup_linear

STAGES = ("train", "val", "test")


class LitTask(CheckpointCompatibility, L.LightningModule):
    """Base of the tasks. Subclasses implement ``_shared_step(batch, stage) -> loss`` and
    save ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``warmup_steps`` with
    ``save_hyperparameters()`` (checked by ``optim.check_optim_args``)."""

    def _shared_step(self, batch, stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._shared_step(batch, "test")

    def log_stage_metric(self, stage: str, name: str, metric: Metric, weight: int) -> None:
        """Log ``stage/name`` once an epoch, in the progress bar outside training."""
        self.log(
            f"{stage}/{name}",
            metric,
            on_step=False,
            on_epoch=True,
            prog_bar=stage != "train",
            batch_size=weight,
        )

    def configure_optimizers(self):
        hp = self.hparams
        return adamw_warmup_linear(
            self,
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            betas=tuple(hp.betas),
            eps=hp.eps,
            warmup_steps=hp.warmup_steps,
            total_steps=int(self.trainer.estimated_stepping_batches),
        )
