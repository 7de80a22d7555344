"""The end-of-run summary: what a run printed when it finished, printed by rank 0.

After ``fit`` and ``test``: the run folder, the test metrics (accuracy beside the
majority-class baseline of the test split), where the metrics, the W&B run and the
checkpoints are. After ``validate``: the run folder; after ``predict``: it and the
predictions file.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from macformer_lit.callbacks.predictions import PredictionWriter
from macformer_lit.loggers import AutoWandbLogger


def report(trainer: L.Trainer, datamodule, run_dir: Path, results: list[dict] | None) -> None:
    """The summary of a ``fit`` or ``test``; ``results``: what ``trainer.test`` returned,
    else the test metrics the trainer holds."""
    if not trainer.is_global_zero:
        return
    lines = [f"Run folder: {run_dir}"]
    metrics = (results or [{}])[0] or {
        k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")
    }
    if "test/acc" in metrics:
        line = f"test/acc = {metrics['test/acc']:.4f}"
        majority = majority_baseline(datamodule)
        if majority is not None:
            line += f"  (majority-class baseline on this test split: {majority:.4f})"
        lines.append(line)
    for key in sorted(metrics):
        if key not in ("test/acc", "test/majority_acc"):  # the latter is on acc's line
            lines.append(f"{key} = {metrics[key]:.4f}")
    for lg in trainer.loggers:
        if isinstance(lg, CSVLogger):
            lines.append(f"CSV metrics: {Path(lg.log_dir) / 'metrics.csv'}")
        elif isinstance(lg, AutoWandbLogger):
            where = lg.run_dir()
            if lg.mode == "offline" and where:
                lines.append(f"W&B offline run: {where}  (upload: wandb sync {where})")
            elif lg.mode == "disabled":
                lines.append("W&B: disabled (WANDB_MODE or --wandb_mode)")
            elif where:
                lines.append(f"W&B run: {where}")
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and ckpt.dirpath and Path(ckpt.dirpath).is_dir():
        lines.append(f"Checkpoints: {ckpt.dirpath} (resume: --ckpt_path last)")
    print("\n".join(lines), flush=True)


def report_folder(trainer: L.Trainer, run_dir: Path) -> None:
    """The summary of a ``validate``: Lightning has printed the metrics."""
    if trainer.is_global_zero:
        print(f"Run folder: {run_dir}", flush=True)


def report_predictions(trainer: L.Trainer, run_dir: Path) -> None:
    writer = next(c for c in trainer.callbacks if isinstance(c, PredictionWriter))
    if trainer.is_global_zero and writer.path is not None:
        print(f"Run folder: {run_dir}", flush=True)
        print(f"Predictions: {writer.path} ({writer.count} examples)", flush=True)


def majority_baseline(datamodule) -> float | None:
    """Share of the most frequent label in the DataModule's test split, if it has one."""
    datasets = getattr(datamodule, "datasets", None)
    labels = getattr((datasets or {}).get("test"), "labels", None)
    if labels is None or len(labels) == 0:
        return None
    counts: dict[int, int] = {}
    for y in labels:
        counts[int(y)] = counts.get(int(y), 0) + 1
    return max(counts.values()) / len(labels)
