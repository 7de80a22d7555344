"""Exact resume through the CLI: a deterministic run stopped mid-epoch at a step boundary and
resumed with ``--ckpt_path last`` logs the same training losses, learning rates and
validation losses, step for step, as a run that was never stopped.

Covered on the way: global step, optimizer and scheduler state, the redrawn random
features (RMFA with redraws every 2 steps) and pre-SBN statistics, the data order inside
the interrupted epoch (``ResumableDataLoader``), and the RNG states behind dropout
(``RNGStateCheckpoint``).
"""

from __future__ import annotations

import pytest
import torch
from ddp_probe import ddp, metric, read_rows, resume_callbacks, run_cli

TOTAL, STOP = 10, 5  # 4 batches an epoch: the stop falls inside the second epoch


def _args(tmp, experiment, devices, *extra):
    callbacks = tmp / f"{experiment}.yaml"
    callbacks.write_text(resume_callbacks(tmp / f"runs/{experiment}/version_0/checkpoints"))
    return [
        "fit",
        "--config",
        "lra_listops.yaml",
        "--config",
        "attention/rmfa_exp.yaml",
        *ddp(devices),
        "--config",
        str(callbacks),
        "--data.data_dir",
        str(tmp / "data"),
        "--data.train_size",
        str(16 * devices),
        "--data.val_size",
        "4",
        "--data.test_size",
        "4",
        "--data.batch_size",
        "4",
        "--model.init_args.d_model",
        "16",
        "--model.init_args.num_layers",
        "1",
        "--model.init_args.attention.num_features",
        "16",
        "--model.init_args.lr",
        "3e-3",
        "--model.init_args.warmup_steps",
        "2",
        "--callbacks.redraw.policy",
        "steps",
        "--callbacks.redraw.every_n_steps",
        "2",
        "--trainer.max_steps",
        str(TOTAL),
        "--trainer.val_check_interval",
        "3",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.deterministic",
        "true",
        "--trainer.enable_progress_bar",
        "false",
        "--runs_dir",
        str(tmp / "runs"),
        "--experiment",
        experiment,
        "--wandb_mode",
        "disabled",
        "--test_after_fit",
        "false",
        *extra,
    ]


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_mid_epoch_equals_uninterrupted_run(tmp_path, monkeypatch, devices):
    run_cli(_args(tmp_path, "full", devices), cwd=tmp_path)
    monkeypatch.setenv("STOP_AT_STEP", str(STOP))
    run_cli(_args(tmp_path, "part", devices), cwd=tmp_path)
    ckpt = torch.load(tmp_path / "runs/part/version_0/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == STOP
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches": 1}]
    assert len(ckpt["rng_states_per_rank"]) == devices
    monkeypatch.delenv("STOP_AT_STEP")
    run_cli(_args(tmp_path, "part", devices, "--ckpt_path", "last"), cwd=tmp_path)

    full = read_rows(tmp_path / "runs/full/version_0/metrics.csv")
    part = read_rows(tmp_path / "runs/part/version_0/metrics.csv")
    losses = metric(part, "train/loss_step")
    # The CSV step is Lightning's batch counter: the batch that made global step s + 1 is
    # logged at step s, before and after the resume alike (no gap, no repeat).
    assert [s for s, _ in losses] == list(range(TOTAL))
    assert losses == metric(full, "train/loss_step")
    assert metric(part, "lr/pg1") == metric(full, "lr/pg1")
    # The stopped run validated once more on its way out (at step STOP - 1).
    val_part = [sv for sv in metric(part, "val/loss") if sv[0] != STOP - 1]
    assert val_part == metric(full, "val/loss") and len(val_part) == 3


def test_resume_cli_last_checkpoint_is_the_latest_step(tmp_path):
    args = _args(tmp_path, "cli", 1)
    i = args.index(str(tmp_path / "cli.yaml"))
    del args[i - 1 : i + 1]  # the CLI's own checkpointing, not resume_callbacks'
    # A vanishing lr: validation accuracy never improves after the first validation.
    run_cli([*args, "--model.init_args.lr", "1e-12", "--trainer.max_steps", "6"], cwd=tmp_path)
    ckpt = tmp_path / "runs/cli/version_0/checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6
