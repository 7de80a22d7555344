"""SIGKILL at an arbitrary point, then ``--ckpt_path last``: the run continues from its
last checkpoint and, in deterministic mode, its metrics.csv ends up identical to that of a
run never killed: every step once, same losses, learning rates and validation values.

The killed process had already written the rows of the steps between its last checkpoint
and the kill (the CSV logger flushes at every log call); the resumed run redoes those steps,
so it must drop those rows first (RunCSVLogger trims metrics.csv to the row count that the
checkpoint recorded).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
from ddp_probe import probe_env, read_rows, run_cli

TOTAL = 12


def _args(tmp, *extra):
    return [
        "fit",
        "--config",
        "lra_listops.yaml",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--data.data_dir",
        str(tmp / "data"),
        "--data.train_size",
        "20",  # 5 batches an epoch: the kill falls inside the second epoch
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
        "--model.init_args.lr",
        "3e-3",
        "--model.init_args.warmup_steps",
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
        "--wandb_mode",
        "disabled",
        "--test_after_fit",
        "false",
        *extra,
    ]


def _kill_at_step(tmp, step):
    """Run the fit until it reaches ``step`` (it then waits, see HangAtStep), SIGKILL it."""
    hang = tmp / "hang.yaml"
    marker = tmp / "hanging"
    hang.write_text(
        "trainer:\n  callbacks:\n    - class_path: ddp_probe.HangAtStep\n"
        f"      init_args: {{step: {step}, marker: {marker}}}\n"
    )
    env = probe_env()
    args = _args(tmp, "--experiment", "killed", "--config", str(hang))
    proc = subprocess.Popen(
        [sys.executable, "-m", "macformer_lit", *args],
        cwd=tmp,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not marker.is_file():
            time.sleep(0.05)
        ended = proc.poll() is not None
        assert not ended, "the run ended before it could be killed: " + proc.stderr.read()
        assert marker.is_file(), "the run did not reach the step in time"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


# ~40 s: kept out of the default run, where test_resume_exact.py (exact resume) and
# tests/cli/test_preemption.py (a signal, then --ckpt_path last) cover the same path.
@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    run_cli(_args(tmp_path, "--experiment", "full"), cwd=tmp_path)
    # Validation (and with it last.ckpt) every 3 steps: killed at step 8, the run
    # restarts from step 6 and has logged steps 6 and 7 twice, unless trimmed.
    _kill_at_step(tmp_path, 8)
    ckpt = tmp_path / "runs/killed/version_0/checkpoints/last.ckpt"
    killed_at = torch.load(ckpt, weights_only=False)["global_step"]
    assert killed_at == 6
    before = read_rows(tmp_path / "runs/killed/version_0/metrics.csv")
    stale = [r for r in before if r.get("train/loss_step") and int(r["step"]) >= killed_at]
    assert [int(r["step"]) for r in stale] == [6, 7]

    run_cli(_args(tmp_path, "--experiment", "killed", "--ckpt_path", "last"), cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "runs/killed").iterdir()) == ["version_0"]
    full = read_rows(tmp_path / "runs/full/version_0/metrics.csv")
    resumed = read_rows(tmp_path / "runs/killed/version_0/metrics.csv")
    for key in ("train/loss_step", "lr/pg1", "val/loss", "val/acc"):
        want = [(r["step"], r[key]) for r in full if r.get(key)]
        got = [(r["step"], r[key]) for r in resumed if r.get(key)]
        assert got == want, key
