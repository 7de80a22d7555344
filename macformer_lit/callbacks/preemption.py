"""Checkpoints that survive kills: atomic writes, and a save on SIGTERM.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the same folder and
renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save
leaves the previous checkpoint intact. ``SaveOnSigterm`` answers a SIGTERM (what SLURM
and most clusters send before pre-emption; Lightning turns it into ``SIGTERMException``
at the next batch boundary), and a first Ctrl-C the same way, by writing ``last.ckpt``
where ModelCheckpoint keeps it and printing the command that resumes from that step.
``MetricsRowsCheckpoint`` keeps ``metrics.csv`` in step with the checkpoints: a run killed
some steps after its last checkpoint has already written those steps' rows, and the
resumed run logs them again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
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
        except (OSError, RuntimeError) as err:
            # torch.save reports a failed write (disk full, file-size limit) as a
            # RuntimeError from its zip writer.
            if isinstance(err, RuntimeError) and "writ" not in str(err).lower():
                raise
            detail = getattr(err, "strerror", None) or str(err).splitlines()[0]
            kept = f"the previous {path.name} is intact" if path.exists() else "nothing written"
            raise OSError(
                f"could not write checkpoint {path} ({detail}): {kept}; free disk space or "
                "point --runs_dir at another disk, then resume with --ckpt_path last"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)


class SaveOnSigterm(L.Callback):
    """``last.ckpt`` at the step a SIGTERM or a Ctrl-C stopped ``fit``, and the command that
    resumes it.

    Lightning raises ``SIGTERMException`` at the next batch boundary after a SIGTERM. During
    ``fit`` a first Ctrl-C (SIGINT) asks for the same stop instead of interrupting the step
    where it is; a second Ctrl-C aborts at once (Python's ``KeyboardInterrupt``), without
    a checkpoint.
    """

    def __init__(self, resume_command: str | None = None) -> None:
        self.resume_command = resume_command
        self.reason = "SIGTERM"
        self._previous_sigint = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous_sigint = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, functools.partial(self._on_sigint, trainer))

    def _on_sigint(self, trainer, signum, frame) -> None:
        if self.reason == "Ctrl-C":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.reason = "Ctrl-C"
        print(
            "\nCtrl-C: stopping at the end of this batch to save last.ckpt "
            "(Ctrl-C again aborts at once, without saving)",
            file=sys.stderr,
            flush=True,
        )
        # What Lightning's own SIGTERM handler sets; the loops stop at the next boundary.
        trainer._signal_connector.received_sigterm = True

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self._previous_sigint is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        exception.stop_reason = self.reason
        ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
        if ckpt is None or ckpt.dirpath is None:
            return
        path = Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}"
        trainer.save_checkpoint(path, weights_only=False)
        how = f": {self.resume_command}" if self.resume_command else " --ckpt_path last"
        step = trainer.global_step
        rank_zero_info(f"{self.reason}: saved {path} at step {step}; resume with{how}")


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
            trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt", weights_only=False)
            self._last_global_step_saved = trainer.global_step
