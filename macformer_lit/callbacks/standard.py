"""The callbacks every CLI run gets besides ``trainer.callbacks``, in one config group.

``--print_config`` shows them under ``callbacks:``, one entry each, as
lightning-hydra-template's ``configs/callbacks/*.yaml`` lists them: an entry is its
settings, ``true`` (its default settings) or ``false`` (switched off), from a config file
or the command line (``--callbacks.nan_guard.action skip``, ``--callbacks.telemetry
false``, ``--callbacks.best_checkpoint.save_top_k 3``). A callback of the same kind in
``trainer.callbacks`` takes the place of the standard one. Keys from before the group
(``--nan_guard.*``, ``--memory.*``, ``--redraw.*``, ``--telemetry.*``,
``--run_callbacks.*``) are read at their new place (``moved_keys.py``).

Not switchable, because a run is not one without them: ``ShareRunDir`` (every rank writes
into rank 0's run folder), ``RecordRun`` (``provenance.yaml``) and, for ``predict``,
``PredictionWriter`` (the subcommand's output); checkpoints are loaded through
``SafeCheckpointIO`` (``--weights_only``), and metrics go to ``metrics.csv`` and W&B
(``--wandb_mode``; a ``trainer.logger`` replaces both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from .distributed import RNGStateCheckpoint
from .memory import ReleaseHostMemory
from .monitor import ThroughputMemoryMonitor
from .nan_guard import NaNGuard
from .preemption import (
    EpochAccumulatorsCheckpoint,
    LatestCheckpoint,
    MetricsRowsCheckpoint,
    SaveOnSigterm,
)
from .redraw import FeatureRedraw
from .telemetry import AttentionTelemetry


# ---- the settings of the entries that have some -------------------------------------------
@dataclass(frozen=True)
class NaNGuardSettings:
    """``NaNGuard``: on a non-finite loss or gradient, write forensics, then stop or skip.

    Args:
        action: ``stop`` training, or ``skip`` the step and go on.
        max_reports: forensics are written for this many bad steps.
        min_loss_scale: under fp16's loss scaling, act once the scale falls below this.
    """

    action: Literal["stop", "skip"] = "stop"
    max_reports: int = 3
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class MemorySettings:
    """``ReleaseHostMemory``: hand freed host memory back after each epoch.

    Args:
        every_n_steps: also every this many training steps (0: only after epochs).
    """

    every_n_steps: int = 0


@dataclass(frozen=True)
class RedrawSettings:
    """``FeatureRedraw``: redraw the random features during training.

    Args:
        policy: ``never``, every ``steps`` (every_n_steps) or every ``epoch``.
        every_n_steps: steps between redraws under ``policy: steps``.
        seed: draw r of layer i is seeded by (seed, i, r).
    """

    policy: Literal["never", "steps", "epoch"] = "never"
    every_n_steps: int = 1000
    seed: int = 0


@dataclass(frozen=True)
class TelemetrySettings:
    """``AttentionTelemetry``: each layer's error against exact attention, logged.

    Args:
        every_n_steps: measure every this many training steps.
        batch_size: on this many sequences of the batch.
        max_queries: on at most this many queries of each.
    """

    every_n_steps: int = 100
    batch_size: int = 1
    max_queries: int = 256


@dataclass(frozen=True)
class BestCheckpointSettings:
    """The best checkpoints by the task's own metric.

    Args:
        save_top_k: how many to keep (-1: all).
    """

    save_top_k: int = 1

    def __post_init__(self) -> None:
        if self.save_top_k < -1:
            raise ValueError(f"save_top_k must be >= -1 (-1: keep all); got {self.save_top_k}")


@dataclass(frozen=True)
class LRMonitorSettings:
    """Lightning's ``LearningRateMonitor``.

    Args:
        logging_interval: log every ``step`` or ``epoch``.
    """

    logging_interval: Literal["step", "epoch"] = "step"


# Entries that build a callback of this package from their settings alone.
SETTINGS_CALLBACKS = {
    "nan_guard": (NaNGuardSettings, NaNGuard),
    "memory": (MemorySettings, ReleaseHostMemory),
    "redraw": (RedrawSettings, FeatureRedraw),
    "telemetry": (TelemetrySettings, AttentionTelemetry),
}
SETTINGS = {
    **{name: kinds[0] for name, kinds in SETTINGS_CALLBACKS.items()},
    "best_checkpoint": BestCheckpointSettings,
    "lr_monitor": LRMonitorSettings,
}


class StandardCallbacks:
    """The standard callbacks: each entry its settings, true (its defaults) or false (off)."""

    def __init__(
        self,
        *,
        nan_guard: NaNGuardSettings | bool = NaNGuardSettings(),
        memory: MemorySettings | bool = MemorySettings(),
        redraw: RedrawSettings | bool = RedrawSettings(),
        telemetry: TelemetrySettings | bool = TelemetrySettings(),
        best_checkpoint: BestCheckpointSettings | bool = BestCheckpointSettings(),
        last_checkpoint: bool = True,
        save_on_sigterm: bool = True,
        metrics_rows: bool = True,
        rng_states: bool = True,
        lr_monitor: LRMonitorSettings | bool = LRMonitorSettings(),
        throughput: bool = True,
    ) -> None:
        """
        Args:
            nan_guard: on a non-finite loss or gradient, write ``nan_forensics/step<k>/``,
                then stop or skip the step (callbacks/nan_guard.py).
            memory: hand the host memory freed tensors leave behind back to the system
                (callbacks/memory.py).
            redraw: redraw the random features on a schedule (callbacks/redraw.py).
            telemetry: log each layer's error against exact attention
                (callbacks/telemetry.py).
            best_checkpoint: keep ``checkpoints/best-step<n>.ckpt``, the best by the task's
                own metric (``val/acc`` or ``val/loss``); the test after fit uses it
                (without it, the last checkpoint).
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
            throughput: log tokens/s, samples/s, step time and peak memory.
        """
        given = {
            "nan_guard": nan_guard,
            "memory": memory,
            "redraw": redraw,
            "telemetry": telemetry,
            "best_checkpoint": best_checkpoint,
            "lr_monitor": lr_monitor,
        }
        for name, value in given.items():
            setattr(self, name, SETTINGS[name]() if value is True else value)
        self.last_checkpoint, self.save_on_sigterm = last_checkpoint, save_on_sigterm
        self.metrics_rows, self.rng_states = metrics_rows, rng_states
        self.throughput = throughput

    @staticmethod
    def settle(group) -> None:
        """The parsed group (a jsonargparse Namespace) made explicit and checked before
        anything is built: an entry given as ``true`` gets its default settings, so
        ``config.yaml`` records what ran; settings a callback would refuse raise
        ``ValueError`` naming the entry."""
        for name, kind in SETTINGS.items():
            value = group.get(name)
            if value is True:
                group[name] = type(group)(**asdict(kind()))
            elif value is not False and value is not None:
                try:
                    settings = kind(**vars(value))
                    if name in SETTINGS_CALLBACKS:
                        SETTINGS_CALLBACKS[name][1](**asdict(settings))
                except ValueError as err:
                    raise ValueError(f"--callbacks.{name}: {err}") from None

    def add_to(
        self,
        callbacks: list[Callback],
        *,
        then: Sequence[Callback] = (),
        run_dir: Path,
        monitor: tuple[str | None, str],
        checkpointing: bool,
        logging: bool,
        resume_command: str,
    ) -> list[Callback]:
        """``callbacks`` (the user's) with the standard ones added where switched on and
        not already there; ``then`` (the run's own, not switchable) goes before the
        entries with settings of their own, which act on the model."""
        out = list(callbacks)

        def missing(kind: type) -> bool:
            return not any(isinstance(c, kind) for c in out)

        # First, so that a resumed run's RNG states are back before other callbacks run.
        if self.rng_states and missing(RNGStateCheckpoint):
            out.insert(0, RNGStateCheckpoint())
        if self.throughput and missing(ThroughputMemoryMonitor):
            out.append(ThroughputMemoryMonitor())
        if self.lr_monitor and logging and missing(LearningRateMonitor):
            out.append(LearningRateMonitor(logging_interval=self.lr_monitor.logging_interval))
        if checkpointing:
            self._add_checkpoints(out, missing, run_dir, monitor, resume_command)
        out += then
        for name, (_, kind) in SETTINGS_CALLBACKS.items():
            settings = getattr(self, name)
            if settings and missing(kind):
                out.append(kind(**asdict(settings)))
        return out

    def _add_checkpoints(self, out, missing, run_dir, monitor, resume_command) -> None:
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
                    save_top_k=self.best_checkpoint.save_top_k,
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
