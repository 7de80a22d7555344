"""``predict`` writes what it predicted: one CSV row per example, in the run folder.

Classification: ``index, prediction, label, prob_0, ..., prob_<C-1>``; translation:
``index, source, translation, reference``. ``index`` is the example's position in the
split (Lightning records each batch's dataset indices), so rows are in split order
whatever the batching (length buckets sort by length). Under DDP every rank predicts its
own share (the evaluation samplers never repeat an example); rank 0 gathers the rows and
writes one file, each example once. The file is written to a temporary name and renamed,
so an interrupted run never leaves half a file.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter

FILENAME = "predictions.csv"


def _rows(prediction: Any, batch_indices: Any, batch: Any) -> list[dict[str, Any]]:
    if not isinstance(prediction, dict):
        raise ValueError(
            f"predict_step returned {type(prediction).__name__}; the prediction writer "
            "needs a dict with 'pred' and 'probs' (classification) or 'translations'"
        )
    indices = [int(i) for i in batch_indices]
    if "translations" in prediction:
        sources = prediction.get("sources") or batch.get("src_text") or [""] * len(indices)
        references = batch.get("tgt_text") or [""] * len(indices)
        return [
            {"index": i, "source": s, "translation": t, "reference": r}
            for i, s, t, r in zip(indices, sources, prediction["translations"], references)
        ]
    preds = prediction["pred"].tolist()
    probs = prediction["probs"].float().cpu().tolist()
    labels = prediction.get("labels")
    labels = labels.tolist() if isinstance(labels, torch.Tensor) else [None] * len(indices)
    rows = []
    for i, p, row, y in zip(indices, preds, probs, labels):
        out = {"index": i, "prediction": p, "label": "" if y is None else y}
        out.update({f"prob_{c}": f"{q:.6g}" for c, q in enumerate(row)})
        rows.append(out)
    return rows


class PredictionWriter(BasePredictionWriter):
    """Write ``predictions.csv`` into the run folder (``trainer.default_root_dir``)."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self._rows: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.count = 0

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rows = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        if batch_indices is None:
            raise ValueError(
                "the predict dataloader gives no example indices (Lightning records them "
                "for a DataLoader with a batch sampler); predictions cannot be written"
            )
        self._rows += _rows(prediction, batch_indices, batch)

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self._rows
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        self._rows = []
        if not trainer.is_global_zero:
            return
        by_index: dict[int, dict[str, Any]] = {}
        for row in rows:
            by_index.setdefault(row["index"], row)
        ordered = [by_index[i] for i in sorted(by_index)]
        self.path = Path(trainer.default_root_dir) / FILENAME
        self.count = len(ordered)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILENAME}.tmp-{os.getpid()}")
        fields = list(ordered[0]) if ordered else ["index"]
        try:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(ordered)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
