"""Trainer assembly: what a run's Trainer is built with, besides its config.

In the run folder: ``default_root_dir``, a CSV logger and W&B (unless ``trainer.logger``
names others), the user's callbacks with ``ShareRunDir`` and the standard ones (the
``callbacks`` group, ``StandardCallbacks``), ``RecordRun`` among them (after
``PredictionWriter`` for ``predict``), and ``SafeCheckpointIO`` for every load. Lightning's
own refusals while building become one line (``settings_errors``), and a resumed fit must
train in its checkpoint's precision (``check_built``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from macformer_lit import provenance, yamlio
from macformer_lit.callbacks.predictions import PredictionWriter
from macformer_lit.checkpoints import AskedCheckpoint, CheckpointError, SafeCheckpointIO
from macformer_lit.errors import LIGHTNING_DIR, raised_under
from macformer_lit.loggers import AutoWandbLogger, RunCSVLogger
from macformer_lit.runs import RecordRun, RunFolders, ShareRunDir, resume_command


class SaveRunConfig(SaveConfigCallback):
    """``config.yaml`` in the run folder, and the same resolved config in the W&B run."""

    def save_config(self, trainer, pl_module, stage) -> None:
        config = self.parser.dump(self.config, skip_none=False, format="yaml")
        for lg in trainer.loggers:
            if isinstance(lg, AutoWandbLogger):
                lg.experiment.config.update({"cli": yamlio.load(config)}, allow_val_change=True)


def trainer_arguments(
    cfg,
    kwargs: dict[str, Any],
    *,
    subcommand: str | None,
    folders: RunFolders,
    experiment: str,
    model: Any,
    argv: list[str],
    asked: AskedCheckpoint,
    asked_precision: Any,
) -> dict[str, Any]:
    """``kwargs`` for LightningCLI's ``instantiate_trainer``, completed from the run's
    instantiated config ``cfg``: its folder, loggers, callbacks and checkpoint plugin."""
    trainer_cfg = cfg.get("trainer", {})
    run_dir = folders.path
    kwargs.setdefault("default_root_dir", str(run_dir))
    logger = trainer_cfg.get("logger")
    if logger is None or logger is True:
        loggers: list[Logger] = [RunCSVLogger(str(run_dir))]
        if cfg.get("wandb_mode") != "disabled":
            loggers.append(
                AutoWandbLogger(
                    save_dir=str(run_dir),
                    project=cfg.get("wandb_project") or "macformer_lit",
                    name=f"{experiment}/{run_dir.name}",
                    mode=cfg.get("wandb_mode") or "auto",
                )
            )
        kwargs["logger"] = loggers
    callbacks = trainer_cfg.get("callbacks") or []
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    callbacks.insert(0, ShareRunDir(folders))
    # Every load (resume, test after fit, validate/test/predict) goes through the
    # same safe path, checkpointing on or off.
    plugins = trainer_cfg.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        safe = cfg.get("weights_only") is not False
        kwargs["plugins"] = [*plugins, SafeCheckpointIO(weights_only=safe)]
    own = [PredictionWriter()] if subcommand == "predict" else []
    own.append(
        RecordRun(
            folders,
            subcommand=subcommand,
            argv=argv,
            asked_precision=asked_precision,
            checkpoint=asked.info,
            changes=asked.changes,
            run_config=asked.run_config,
        )
    )
    callbacks = cfg.get("callbacks").add_to(
        callbacks,
        then=own,
        run_dir=run_dir,
        monitor=getattr(model, "checkpoint_monitor", (None, "min")),
        checkpointing=trainer_cfg.get("enable_checkpointing", True) is not False,
        logging=bool(kwargs.get("logger", logger)),
        resume_command=resume_command(argv),
    )
    kwargs["callbacks"] = callbacks
    return kwargs


@contextlib.contextmanager
def settings_errors() -> Iterator[None]:
    """Lightning's own checks while building the Trainer (accelerator, strategy, devices,
    precision, loop limits): a settings problem, worth one line rather than a traceback
    from its internals."""
    try:
        yield
    except (ValueError, TypeError, MisconfigurationException) as err:
        if not raised_under(err, LIGHTNING_DIR):
            raise
        hint = ""
        if "gpu" in str(err).lower() or "cuda" in str(err).lower():
            hint = " (on a machine without a GPU use --trainer.accelerator cpu or auto)"
        raise ValueError(f"invalid trainer settings: {err}{hint}") from None


def check_built(trainer: L.Trainer, *, subcommand: str | None, asked: AskedCheckpoint) -> None:
    """The Trainer as built: a resumed fit keeps its checkpoint's precision, and its
    folder's first config.yaml (a resume's changes go to provenance.yaml)."""
    check_precision(trainer, subcommand=subcommand, asked=asked)
    for callback in trainer.callbacks:
        if isinstance(callback, SaveRunConfig) and asked.resume_dir is not None:
            callback.save_to_log_dir = False


def check_precision(trainer: L.Trainer, *, subcommand: str | None, asked: AskedCheckpoint) -> None:
    """A resumed fit trains in the precision its checkpoint trained in: the same
    ``--trainer.precision`` can run another one on another machine (16-mixed runs bf16
    on a CPU, fp16 on a GPU)."""
    if subcommand != "fit" or asked.contents is None:
        return
    recorded = asked.contents.get(provenance.CHECKPOINT_KEY)
    used = recorded.get("precision") if isinstance(recorded, dict) else None
    if used is not None and used != str(trainer.precision):
        raise CheckpointError(
            f"this resume would change what is trained (--ckpt_path {asked.path}): precision: "
            f"checkpoint trained in {used}, this run would train in {trainer.precision} "
            f"on {type(trainer.accelerator).__name__.replace('Accelerator', '')}. A resume "
            f"continues the same training: resume where --trainer.precision runs {used}, "
            "or leave out --ckpt_path to start a new run with these settings"
        )
