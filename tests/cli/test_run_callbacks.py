"""The standard callbacks of a CLI run (callbacks/standard.py): shown by --print_config,
each switched off or retuned from the command line or a config file."""

from __future__ import annotations

import subprocess
import sys

import yaml
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from macformer_lit.callbacks.distributed import RNGStateCheckpoint
from macformer_lit.callbacks.monitor import ThroughputMemoryMonitor
from macformer_lit.callbacks.preemption import (
    LatestCheckpoint,
    MetricsRowsCheckpoint,
    SaveOnSigterm,
)
from macformer_lit.cli import MacformerCLI

ALL = (
    RNGStateCheckpoint,
    ThroughputMemoryMonitor,
    LearningRateMonitor,
    LatestCheckpoint,
    SaveOnSigterm,
    MetricsRowsCheckpoint,
)


def build(tmp_path, *extra):
    args = [
        "--config",
        "listops_short_cpu.yaml",
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.train_size",
        "16",
        "--data.val_size",
        "8",
        "--data.test_size",
        "8",
        "--runs_dir",
        str(tmp_path / "runs"),
        "--wandb_mode",
        "disabled",
        *extra,
    ]
    return MacformerCLI(args, run=False).trainer


def kinds(trainer) -> list[type]:
    return [type(c) for c in trainer.callbacks]


def test_every_standard_callback_is_on_by_default(tmp_path):
    trainer = build(tmp_path)
    for kind in ALL:
        assert kinds(trainer).count(kind) == 1, kind
    best = trainer.checkpoint_callback
    assert type(best) is ModelCheckpoint and best.monitor == "val/acc" and best.save_top_k == 1


def test_each_can_be_switched_off_or_retuned_from_the_command_line(tmp_path):
    trainer = build(
        tmp_path,
        "--run_callbacks.rng_states",
        "false",
        "--run_callbacks.throughput",
        "false",
        "--run_callbacks.lr_monitor",
        "false",
        "--run_callbacks.save_on_sigterm",
        "false",
        "--run_callbacks.metrics_rows",
        "false",
        "--run_callbacks.save_top_k",
        "3",
    )
    present = kinds(trainer)
    for kind in (RNGStateCheckpoint, ThroughputMemoryMonitor, LearningRateMonitor):
        assert kind not in present
    for kind in (SaveOnSigterm, MetricsRowsCheckpoint):
        assert kind not in present
    assert trainer.checkpoint_callback.save_top_k == 3
    assert LatestCheckpoint in present


def test_from_a_config_file_without_the_best_checkpoint(tmp_path):
    config = tmp_path / "lean.yaml"
    config.write_text(
        yaml.safe_dump(
            {"run_callbacks": {"best_checkpoint": False, "lr_logging_interval": "epoch"}}
        )
    )
    trainer = build(tmp_path, "--config", str(config))
    # The last checkpoint is then the one the test after fit reads.
    assert type(trainer.checkpoint_callback) is LatestCheckpoint
    assert [type(c) for c in trainer.callbacks].count(LatestCheckpoint) == 1
    lr = next(c for c in trainer.callbacks if isinstance(c, LearningRateMonitor))
    assert lr.logging_interval == "epoch"


def test_print_config_shows_the_group(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", "listops_short_cpu.yaml",
         "--print_config"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    group = yaml.safe_load(out)["run_callbacks"]
    assert group == {
        "best_checkpoint": True,
        "save_top_k": 1,
        "last_checkpoint": True,
        "save_on_sigterm": True,
        "metrics_rows": True,
        "rng_states": True,
        "lr_monitor": True,
        "lr_logging_interval": "step",
        "throughput": True,
    }
