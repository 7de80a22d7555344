"""The callbacks every CLI run gets besides ``trainer.callbacks``, in one visible config group.

``--print_config`` shows them under ``run_callbacks:``, and each can be switched off or
retuned from a config file or the command line (``--run_callbacks.lr_monitor false``,
``--run_callbacks.save_top_k 3``). A callback of the same kind in ``trainer.callbacks``
takes the place of the standard one. The always-on callbacks with settings of their own
have their own groups (``nan_guard``, ``memory``, ``redraw``, ``telemetry``).

Not switchable, because a run is not one without them: ``ShareRunDir`` (every rank writes
into rank 0's run folder) and, for ``predict``, ``PredictionWriter`` (the subcommand's
output); checkpoints are loaded through ``SafeCheckpointIO`` (``--weights_only``), and
metrics go to ``metrics.csv`` and W&B (``--wandb_mode``; a ``trainer.logger`` replaces
both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from .distributed import RNGStateCheckpoint
from .monitor import ThroughputMemoryMonitor
from .preemption import (
    EpochAccumulatorsCheckpoint,
    LatestCheckpoint,
    MetricsRowsCheckpoint,
    SaveOnSigterm,
)


class RunCallbacks:
    def __init__(
        self,
        *,
        best_checkpoint: bool = True,
        save_top_k: int = 1,
        last_checkpoint: bool = True,
        save_on_sigterm: bool = True,
        metrics_rows: bool = True,
        rng_states: bool = True,
        lr_monitor: bool = True,
        lr_logging_interval: Literal["step", "epoch"] = "step",
        throughput: bool = True,
    ) -> None:
        """
        Args:
            best_checkpoint: keep ``checkpoints/best-step<n>.ckpt``, the best by the task's
                own metric (``val/acc`` or ``val/loss``); the test after fit uses it (without
                it, the last checkpoint).
            save_top_k: how many best checkpoints to keep.
            last_checkpoint: keep ``checkpoints/last.ckpt`` up to date (what
                ``--ckpt_path last`` resumes).
            save_on_sigterm: on SIGTERM or Ctrl-C, write ``last.ckpt`` at the current step
                and print the command that resumes.
            metrics_rows: checkpoints record how many ``metrics.csv`` rows they cover, so
                a resumed run drops the rows logged after it, and the training epoch's
                running averages so far, so a resumed epoch logs the uninterrupted run's
                ``train/loss_epoch``, ``train/acc`` (``EpochAccumulatorsCheckpoint``).
            rng_states: checkpoints carry every random generator's state, so a resumed run
                continues as if never stopped.
            lr_monitor: log the learning rate (with a logger).
            lr_logging_interval: every ``step`` or ``epoch``.
            throughput: log tokens/s, samples/s, step time and peak memory.
        """
        if save_top_k < -1:
            raise ValueError(f"run_callbacks.save_top_k must be >= -1; got {save_top_k}")
        self.best_checkpoint, self.save_top_k = best_checkpoint, save_top_k
        self.last_checkpoint, self.save_on_sigterm = last_checkpoint, save_on_sigterm
        self.metrics_rows, self.rng_states = metrics_rows, rng_states
        self.lr_monitor, self.lr_logging_interval = lr_monitor, lr_logging_interval
        self.throughput = throughput

    def add_to(
        self,
        callbacks: list[Callback],
        *,
        run_dir: Path,
        monitor: tuple[str | None, str],
        checkpointing: bool,
        logging: bool,
        resume_command: str,
    ) -> list[Callback]:
        """``callbacks`` (the user's) with the standard ones added where switched on and
        not already there."""
        out = list(callbacks)

        def missing(kind: type) -> bool:
            return not any(isinstance(c, kind) for c in out)

        # First, so that a resumed run's RNG states are back before other callbacks run.
        if self.rng_states and missing(RNGStateCheckpoint):
            out.insert(0, RNGStateCheckpoint())
        if self.throughput and missing(ThroughputMemoryMonitor):
            out.append(ThroughputMemoryMonitor())
        if self.lr_monitor and logging and missing(LearningRateMonitor):
            out.append(LearningRateMonitor(logging_interval=self.lr_logging_interval))
        if not checkpointing:
            return out
        checkpoints = str(run_dir / "checkpoints")
        # A ModelCheckpoint of the user's takes the place of both checkpoint callbacks.
        own = missing(ModelCheckpoint)
        if self.best_checkpoint and own:
            metric, mode = monitor
            out.append(
                ModelCheckpoint(
                    dirpath=checkpoints,
                    filename="best-step{step}",
                    auto_insert_metric_name=False,
                    monitor=metric,
                    mode=mode,
                    save_top_k=self.save_top_k,
                )
            )
        # After the monitored one, which stays trainer.checkpoint_callback.
        if self.last_checkpoint and own:
            out.append(LatestCheckpoint(dirpath=checkpoints))
        if self.save_on_sigterm and missing(SaveOnSigterm):
            out.append(SaveOnSigterm(resume_command))
        if self.metrics_rows and missing(MetricsRowsCheckpoint):
            out.append(MetricsRowsCheckpoint())
        # After MetricsRowsCheckpoint, whose trimmed metrics.csv it reads on resume.
        if self.metrics_rows and missing(EpochAccumulatorsCheckpoint):
            out.append(EpochAccumulatorsCheckpoint())
        return out
