"""LitClassifier: LRA sequence classification (and Retrieval with ``dual_encoder``).

One ``_shared_step(batch, stage)``; loss and accuracy per stage under ``stage/name`` keys
(Lightning's autoencoder example, lightning-hydra-template ``mnist_module.py``).

Validation and test values are exact under DDP: accuracy and the example-weighted mean
loss are torchmetrics states summed over ranks. (Lightning's own ``sync_dist`` mean divides
an all-reduced integer example count by the world size, which truncates when ranks saw
different numbers of examples, as they do in evaluation without padding.) The training
loss (``train/loss_step``, ``train/loss_epoch``) is the mean over the whole global batch,
all ranks included (``reduce.global_mean``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from macformer_lit.models import DualEncoderClassifier, EncoderClassifier

from .base import STAGES, LitTask
from .optim import check_optim_args
from .reduce import eval_mean_losses, log_stage_loss


class MajorityShare(Metric):
    """The share of the most frequent label among the labels seen: the accuracy of always
    predicting the majority class of this split (summed over DDP ranks). Logged as
    ``val/majority_acc`` and ``test/majority_acc``, the line a plateau sits on."""

    full_state_update = False

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.add_state("counts", torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, labels: torch.Tensor) -> None:
        self.counts += torch.bincount(labels.flatten(), minlength=self.counts.numel())

    def compute(self) -> torch.Tensor:
        return self.counts.max().float() / self.counts.sum().clamp_min(1)


class LitClassifier(LitTask):
    # The metric ModelCheckpoint keeps the best of, and whether higher is better.
    checkpoint_monitor = ("val/acc", "max")

    # The task's own options; the model's are EncoderClassifier's (LitTask).
    model_classes = (EncoderClassifier, DualEncoderClassifier)

    def __init__(
        self,
        *,
        dual_encoder: bool = False,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        warmup_steps: int = 1000,
        **model: Any,
    ) -> None:
        """
        Args:
            dual_encoder: two documents per example (LRA Retrieval).
            lr, weight_decay, betas, eps, warmup_steps: AdamW, linear warm-up then decay.
            **model: the classifier's options (``models.EncoderClassifier``: sizes,
                ``attention``, ``pooling``), passed to it as they are.
        """
        super().__init__()
        check_optim_args(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps)
        specs = self.parse_specs(model)
        self.save_hyperparameters()
        self.record_model_defaults()
        model.update(specs)  # the model builds from the parsed values
        # Direct calls with **model: jsonargparse reads the options from both signatures.
        if not dual_encoder:
            self.model = EncoderClassifier(**model)
        else:
            self.model = DualEncoderClassifier(**model)
        num_classes = self.hparams.num_classes
        # nn.Module reserves the key "train", hence the suffix.
        self.acc = torch.nn.ModuleDict(
            {f"{s}_acc": MulticlassAccuracy(num_classes, average="micro") for s in STAGES}
        )
        self.mean_loss = eval_mean_losses()
        self.majority = torch.nn.ModuleDict(
            {f"{s}_majority": MajorityShare(num_classes) for s in STAGES if s != "train"}
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.hparams.dual_encoder:
            if "input_ids_0" not in batch:
                raise ValueError("dual_encoder=True needs two-document batches (LRA Retrieval)")
            return self.model(
                batch["input_ids_0"],
                batch.get("padding_mask_0"),
                batch["input_ids_1"],
                batch.get("padding_mask_1"),
            )
        if "input_ids" not in batch:
            raise ValueError(
                "this batch holds two documents: set model.dual_encoder: true for LRA Retrieval"
            )
        return self.model(batch["input_ids"], batch.get("padding_mask"))

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        acc = self.acc[f"{stage}_acc"]
        acc(logits, batch["labels"])
        batch_size = batch["labels"].shape[0]
        log_stage_loss(self, stage, loss, batch_size)
        self.log_stage_metric(stage, "acc", acc, batch_size)
        if stage != "train":
            majority = self.majority[f"{stage}_majority"]
            majority(batch["labels"])
            self.log(f"{stage}/majority_acc", majority, on_step=False, on_epoch=True,
                     batch_size=batch_size)  # fmt: skip
        return loss

    def predict_step(self, batch, batch_idx):
        probs = self(batch).float().softmax(-1)
        return {"pred": probs.argmax(-1), "probs": probs, "labels": batch.get("labels")}
