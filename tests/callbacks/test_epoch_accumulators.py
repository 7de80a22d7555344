"""The training epoch's averages survive a stop inside the epoch: ``EpochAccumulatorsCheckpoint``.

A fit stopped by a real SIGTERM in the middle of an epoch (``PauseAt`` from
tests/cli/test_interruptions.py holds it at a known step) and resumed with ``--ckpt_path
last`` logs the epoch's ``train/loss_epoch`` and ``train/acc`` of a run never stopped. One
process is covered by test_interruptions.py (every phase); here, two processes (DDP on
CPU, gloo): the accuracy's states are summed over ranks into the checkpoint and restored on
rank 0 only, so the epoch end's sync counts every example once, and each rank gets its own
loss sums back. Plus an old checkpoint (without the entry) still resumes.
"""

from __future__ import annotations

import csv
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from test_interruptions import _fit_args, _interrupt, _run  # noqa: E402

from macformer_lit.callbacks.preemption import EpochAccumulatorsCheckpoint  # noqa: E402

EPOCH_KEYS = ("train/acc", "train/loss_epoch")
KEY = EpochAccumulatorsCheckpoint.KEY


def _epoch_rows(run: Path) -> list[tuple[str, str, dict[str, str]]]:
    """(step, epoch, {train/acc, train/loss_epoch}) of every row that has them, in order."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        values = {k: r[k] for k in EPOCH_KEYS if r.get(k)}
        if values:
            out.append((r["step"], r["epoch"], values))
    return out


def _val_rows(run: Path) -> list[tuple[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


def _ddp_args(tmp: Path, experiment: str) -> list[str]:
    args = _fit_args(tmp, experiment)
    args[args.index("--data.train_size") + 1] = "32"  # 4 batches an epoch on each rank
    args[args.index("--data.data_dir") + 1] = str(tmp / "data")
    return [
        *args,
        "--config",
        "trainer/ddp.yaml",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
    ]


# ~90 s on a loaded 2-core machine (three 2-process fits).
@pytest.mark.slow
def test_two_process_resume_mid_epoch_logs_the_uninterrupted_epoch_averages(tmp_path):
    ref = _run(_ddp_args(tmp_path, "ref"), tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "MEMBER: 2/2" in ref.stdout + ref.stderr

    args = _ddp_args(tmp_path, "cut")
    code, out, err = _interrupt(args, tmp_path, "train:3", signal.SIGTERM)
    assert code == 143, err[-3000:]
    run = tmp_path / "runs/cut/version_0"
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3
    saved = ckpt[KEY]
    assert saved["epoch"] == 0 and saved["world_size"] == 2
    # The accuracy's counts are those of both ranks' 3 x 4 examples, summed.
    acc = saved["metrics"]["training_step.train/acc"]["states"]
    assert int(acc["tp"] + acc["fn"]) == 2 * 3 * 4
    loss = saved["tensors"]["training_step.train/loss"]["states"]
    assert loss.shape == (2, 2) and torch.equal(loss[0], loss[1])  # the global-batch mean

    resumed = _run([*args, "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = tmp_path / "runs/ref/version_0"
    want = _epoch_rows(reference)
    assert [(s, e) for s, e, _ in want] == [("3", "0"), ("5", "1")]
    # Integer counts and the same float additions: equal, not close.
    assert _epoch_rows(run) == want
    assert _val_rows(run) == _val_rows(reference)


def test_a_checkpoint_without_the_entry_still_resumes(tmp_path):
    """Checkpoints written before EpochAccumulatorsCheckpoint resume as they did: the
    epoch's averages cover the resumed batches only."""
    args = _fit_args(tmp_path, "old")
    code, out, err = _interrupt(args, tmp_path, "train:3", signal.SIGTERM)
    assert code == 143, err[-3000:]
    last = tmp_path / "runs/old/version_0/checkpoints/last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    assert KEY in ckpt
    del ckpt[KEY]
    torch.save(ckpt, last)
    resumed = _run([*args, "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _epoch_rows(tmp_path / "runs/old/version_0")
    assert [(s, e) for s, e, _ in rows] == [("3", "0"), ("5", "1")]
