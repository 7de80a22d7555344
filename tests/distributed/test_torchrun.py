"""Ranks started all at once by an external launcher (torchrun here; SLURM works the same
way) share rank 0's run folder: no rank leaves an empty ``version_<n+1>`` beside it, and
every rank's ``default_root_dir`` (where NaN forensics go) is rank 0's folder.

Without the fix, rank 1 guessed the next free version after rank 0 had created its own,
and its W&B logger created that folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ddp_probe import HERE

ARGS = [
    "fit",
    "--config",
    "lra_listops.yaml",
    "--config",
    "trainer/ddp.yaml",
    "--trainer.accelerator",
    "cpu",
    "--trainer.devices",
    "2",
    "--data.train_size",
    "16",
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
    "--trainer.max_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--wandb_mode",
    "offline",
    "--experiment",
    "tr",
]


def torchrun(tmp: Path) -> None:
    probe = tmp / "probe.yaml"
    probe.write_text(
        "trainer:\n  callbacks:\n    - class_path: ddp_probe.RootDirProbe\n"
        f"      init_args: {{out: {tmp / 'probe'}}}\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "WANDB_SILENT": "true",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("WANDB_MODE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "macformer_lit", *ARGS]
    cmd += ["--config", str(probe), "--data.data_dir", str(tmp / "data")]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr


def test_torchrun_ranks_share_rank_zeros_run_folder(tmp_path):
    (tmp_path / "runs/tr/version_0").mkdir(parents=True)  # an earlier run
    torchrun(tmp_path)
    assert sorted(p.name for p in (tmp_path / "runs/tr").iterdir()) == ["version_0", "version_1"]
    run = (tmp_path / "runs/tr/version_1").resolve()
    assert (run / "metrics.csv").is_file() and (run / "checkpoints/last.ckpt").is_file()
    roots = [Path((tmp_path / f"probe/root_rank{r}.txt").read_text()) for r in (0, 1)]
    assert [(tmp_path / r).resolve() for r in roots] == [run, run]
