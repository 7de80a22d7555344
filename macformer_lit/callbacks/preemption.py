"""Checkpoints that survive kills: atomic writes, and a save on SIGTERM.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the same folder and
renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save
leaves the previous checkpoint intact. ``SaveOnSigterm`` answers a SIGTERM (what SLURM
and most clusters send before pre-emption; Lightning turns it into ``SIGTERMException``
at the next batch boundary) by writing ``last.ckpt`` where ModelCheckpoint keeps it, so
``--ckpt_path last`` resumes from the step the job was stopped at. ``MetricsRowsCheckpoint``
keeps ``metrics.csv`` in step with the checkpoints: a run killed some steps after its last
checkpoint has already written those steps' rows, and the resumed run logs them again.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException


class MetricsRowsCheckpoint(L.Callback):
    """Record in each checkpoint how many rows ``metrics.csv`` held when it was saved; on
    resume, drop the rows logged after it at the checkpoint's global step or later (the
    resumed run logs those steps again), so the file ends up as that of a run never
    interrupted. (A validation logged after a checkpoint saved at the end of a training
    batch, at that same step, counts as after it.)"""

    KEY = "metrics_csv_rows"

    @staticmethod
    def _csv_loggers(trainer):
        from macformer_lit.loggers import RunCSVLogger

        return [lg for lg in trainer.loggers if isinstance(lg, RunCSVLogger)]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        loggers = self._csv_loggers(trainer)
        if trainer.is_global_zero and loggers:
            checkpoint[self.KEY] = loggers[0].rows_on_disk()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        rows = checkpoint.get(self.KEY)
        if rows is None or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        step = int(checkpoint.get("global_step", 0))
        for lg in self._csv_loggers(trainer):
            dropped = lg.drop_rows_after(rows, step)
            if dropped:
                rank_zero_info(
                    f"{lg.metrics_path}: dropped {dropped} row(s) logged after the checkpoint "
                    f"at step {step}; those steps run again"
                )


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class SaveOnSigterm(L.Callback):
    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
        if ckpt is None or ckpt.dirpath is None:
            return
        path = Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}"
        trainer.save_checkpoint(path)
        rank_zero_info(
            f"SIGTERM: saved {path} at step {trainer.global_step}; resume with --ckpt_path last"
        )


class LatestCheckpoint(ModelCheckpoint):
    """``last.ckpt`` at the latest step: after every validation and when training ends.

    Lightning 2.6 refreshes a monitored checkpoint's ``last.ckpt`` only when the metric
    improves, and an unmonitored one saves only at validation, so a run that ends between
    validations would leave ``--ckpt_path last`` a stale step.
    """

    def __init__(self, *, dirpath: str) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            enable_version_counter=False,
        )

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        if trainer.global_step != self._last_global_step_saved:
            trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt")
            self._last_global_step_saved = trainer.global_step
