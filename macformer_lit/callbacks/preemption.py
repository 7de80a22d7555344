"""Checkpoints that survive kills: atomic writes, and a save on SIGTERM.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the same folder and
renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save
leaves the previous checkpoint intact. ``SaveOnSigterm`` answers a SIGTERM (what SLURM
and most clusters send before pre-emption; Lightning turns it into ``SIGTERMException``
at the next batch boundary), and a first Ctrl-C or a SIGHUP the same way, by writing
``last.ckpt`` where ModelCheckpoint keeps it and printing the command that resumes from that
step; a validation it interrupts runs again on resume.
``MetricsRowsCheckpoint`` keeps ``metrics.csv`` in step with the checkpoints: a run killed
some steps after its last checkpoint has already written those steps' rows, and the
resumed run logs them again.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.evaluation_loop import RestartStage as _EvalRestartStage
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from macformer_lit import interrupts

_MID_EVALUATION = _EvalRestartStage.RESTARTED_MID_EVALUATION


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
    """``last.ckpt`` at the step a SIGTERM, a SIGHUP or a Ctrl-C stopped ``fit``, and the
    command that resumes it; the resumed run ends as one never stopped.

    Lightning raises ``SIGTERMException`` at the next batch boundary after a SIGTERM. While
    a fit trains, a first Ctrl-C (SIGINT) and a SIGHUP (a closed terminal) ask for the same
    stop instead of killing the step where it is; a second Ctrl-C aborts at once, without a
    checkpoint (``interrupts.Interrupted``).

    A stop inside a validation saves the loop state of that validation's start and marks
    the checkpoint (``RERUN_KEY``): the resumed run runs the whole validation again, so its
    metrics, best checkpoint and ``last.ckpt`` are those of an uninterrupted run (Lightning
    would skip it). A stop saved after a finished validation holds Lightning's logging step
    one back, as its own checkpoints at the end of a validation do: Lightning's resume adds
    that one again.
    """

    RERUN_KEY = "rerun_validation"

    def __init__(self, resume_command: str | None = None) -> None:
        self.resume_command = resume_command
        self.reason = "SIGTERM"
        self._stop_signal: int | None = None
        self._previous: dict = {}
        self._val_progress: dict | None = None  # the val loop's progress as a validation starts
        self._stepped_at_val: int | None = None
        self._validated_at: int | None = None
        self._in_validation = False
        self._stopped_in_validation = False
        self._rerun = False

    # ---- signals -------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self._rerun:
            self._rerun = False
            # Lightning's resume runs a validation it finds begun (and skips one it finds
            # finished): the checkpoint holds the progress of its start, so it runs whole.
            trainer.fit_loop.epoch_loop.val_loop._restart_stage = _MID_EVALUATION
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        # After Lightning set its SIGTERM handler (it does once on_fit_start has run).
        for signum in (signal.SIGINT, signal.SIGHUP):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, functools.partial(self._on_signal, trainer))
        # interrupts' handler, which Lightning's SIGTERM handler also calls: name the stop.
        interrupts.graceful = functools.partial(self._note, trainer)

    def _note(self, trainer, signum: int) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self.reason = interrupts.NAMES.get(signum, f"signal {signum}")
        trainer._signal_connector.received_sigterm = True

    def _on_signal(self, trainer, signum, frame) -> None:
        if self._stop_signal == signal.SIGINT and signum == signal.SIGINT:
            raise interrupts.Interrupted(signum)  # a second Ctrl-C: abort, no checkpoint
        first = self._stop_signal is None
        self._note(trainer, signum)
        if first:
            what = interrupts.NAMES[signum]
            again = ""
            if signum == signal.SIGINT:
                again = " (Ctrl-C again aborts at once, without saving)"
            with contextlib.suppress(OSError, ValueError):  # a closed terminal
                print(
                    f"\n{what}: stopping at the end of this batch to save last.ckpt{again}",
                    file=sys.stderr,
                    flush=True,
                )
        # Other DDP ranks stop through Lightning's launcher, as on a SIGTERM.
        launcher = trainer.strategy.launcher
        if first and launcher is not None and hasattr(launcher, "kill"):
            with contextlib.suppress(Exception):
                launcher.kill(signal.SIGTERM)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        interrupts.graceful = None
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # ---- validations -----------------------------------------------------------------------
    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        loop = trainer.fit_loop.epoch_loop
        self._val_progress = copy.deepcopy(loop.val_loop.batch_progress.state_dict())
        self._stepped_at_val = loop._batches_that_stepped
        self._in_validation = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._in_validation = False
            self._validated_at = trainer.global_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        loops = checkpoint.get("loops", {}).get("fit_loop")
        if trainer.state.fn != "fit" or not isinstance(loops, dict):
            return
        if self._stopped_in_validation and self._val_progress is not None:
            loops["epoch_loop.val_loop.batch_progress"] = copy.deepcopy(self._val_progress)
            checkpoint[self.RERUN_KEY] = True
        elif (
            self._validated_at == trainer.global_step
            and self._stepped_at_val is not None
            and trainer.fit_loop.epoch_loop._batches_that_stepped == self._stepped_at_val + 1
        ):
            # Saved after the step that follows a validation was counted (a stop, the end of
            # training): Lightning's resume counts it again.
            state = loops.get("epoch_loop.state_dict")
            if isinstance(state, dict) and "_batches_that_stepped" in state:
                state["_batches_that_stepped"] = self._stepped_at_val

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._rerun = bool(checkpoint.get(self.RERUN_KEY)) and trainer.state.fn == "fit"

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        exception.stop_reason = self.reason
        exception.stop_signal = self._stop_signal or signal.SIGTERM
        ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
        if ckpt is None or ckpt.dirpath is None:
            return
        path = Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}"
        self._stopped_in_validation = self._in_validation
        try:
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._stopped_in_validation = False
        how = f": {self.resume_command}" if self.resume_command else " --ckpt_path last"
        step = trainer.global_step
        where = " (in a validation, which the resume runs again)" if self._in_validation else ""
        rank_zero_info(f"{self.reason}: saved {path} at step {step}{where}; resume with{how}")


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
