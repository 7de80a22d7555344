"""Ranks started all at once by an external launcher share rank 0's run folder: no rank
leaves an empty ``version_<n+1>`` beside it, and every rank's ``default_root_dir`` (where
NaN forensics go) is rank 0's folder.

- torchrun: 2 processes on this machine.
- SLURM, as ``srun`` starts a job of 2 nodes with 1 task each: two processes with the
  environment srun gives each task (``SLURM_PROCID``, ``SLURM_NODEID``, ...), which
  Lightning's ``SLURMEnvironment`` reads, and ``--trainer.num_nodes 2``. Both "nodes" are
  this machine (``MASTER_ADDR=127.0.0.1``), so this runs the multi-node code path of the
  CLI and Lightning, not SLURM itself.

Without the fix, rank 1 guessed the next free version after rank 0 had created its own,
and its W&B logger created that folder.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_probe import probe_env

ARGS = [
    "fit",
    "--config",
    "lra_listops.yaml",
    "--config",
    "trainer/ddp.yaml",
    "--trainer.accelerator",
    "cpu",
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


def _setup(tmp: Path) -> tuple[list[str], dict[str, str]]:
    probe = tmp / "probe.yaml"
    probe.write_text(
        "trainer:\n  callbacks:\n    - class_path: ddp_probe.RootDirProbe\n"
        f"      init_args: {{out: {tmp / 'probe'}}}\n"
    )
    env = probe_env(OMP_NUM_THREADS="1")
    (tmp / "runs/tr/version_0").mkdir(parents=True)  # an earlier run
    return [*ARGS, "--config", str(probe), "--data.data_dir", str(tmp / "data")], env


def _check_one_new_run_folder(tmp: Path) -> None:
    assert sorted(p.name for p in (tmp / "runs/tr").iterdir()) == ["version_0", "version_1"]
    run = (tmp / "runs/tr/version_1").resolve()
    assert (run / "metrics.csv").is_file() and (run / "checkpoints/last.ckpt").is_file()
    roots = [Path((tmp / f"probe/root_rank{r}.txt").read_text()) for r in (0, 1)]
    assert [(tmp / r).resolve() for r in roots] == [run, run]


def test_torchrun_ranks_share_rank_zeros_run_folder(tmp_path):
    args, env = _setup(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "macformer_lit", *args, "--trainer.devices", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr
    _check_one_new_run_folder(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_slurm_two_nodes_share_rank_zeros_run_folder(tmp_path):
    args, env = _setup(tmp_path)
    cmd = [sys.executable, "-m", "macformer_lit", *args]
    cmd += ["--trainer.devices", "1", "--trainer.num_nodes", "2"]
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "macformer",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_LOCALID": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    procs = [
        subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**env, **slurm, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outs[1]
    _check_one_new_run_folder(tmp_path)
