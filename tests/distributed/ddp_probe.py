"""Helpers for tests/distributed: run the CLI in a subprocess, read metrics.csv, and a
callback (importable by the subprocess through PYTHONPATH) that dumps per-rank state.

DDP must run in a subprocess: in-process ``ddp`` re-launches pytest's own command line.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch

from macformer_lit.attention import PPSBNAttention, random_feature_backends

HERE = Path(__file__).resolve().parent


def probe_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this folder importable (probe callbacks), W&B
    quiet and left to ``--wandb_mode``, hashing fixed; ``extra`` on top."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "WANDB_SILENT": "true",
        "PYTHONHASHSEED": "0",
        **extra,
    }
    env.pop("WANDB_MODE", None)
    return env


def run_cli(
    args: list[str], cwd: Path, *, timeout: int = 240, expect_ok: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", *args],
        cwd=cwd,
        env=probe_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def ddp(devices: int) -> list[str]:
    preset = ["--config", "trainer/ddp.yaml"] if devices > 1 else []
    return [*preset, "--trainer.accelerator", "cpu", "--trainer.devices", str(devices)]


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def metric(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row that has ``key``."""
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def rmfa_precision_run(tmp: Path, experiment: str, steps: int, *extra: str):
    """Fit ListOps with RMFA (exp kernel) + ppSBN for ``steps`` steps, tiny sizes, under the
    mixed-precision settings in ``extra``; returns the subprocess and the run's metrics rows."""
    proc = run_cli(
        ["fit", "--config", "lra_listops.yaml", "--config", "attention/rmfa_exp.yaml", *extra]
        + ["--data.data_dir", str(tmp / "data"), "--data.train_size", "32"]
        + ["--data.val_size", "8", "--data.test_size", "8", "--data.batch_size", "4"]
        + ["--model.init_args.d_model", "32", "--model.init_args.lr", "3e-3"]
        + ["--model.init_args.warmup_steps", "1", "--trainer.max_steps", str(steps)]
        + ["--trainer.val_check_interval", str(steps), "--trainer.log_every_n_steps", "1"]
        + ["--trainer.enable_progress_bar", "false", "--runs_dir", str(tmp / "runs")]
        + ["--experiment", experiment, "--wandb_mode", "disabled"],
        cwd=tmp,
    )
    return proc, read_rows(tmp / f"runs/{experiment}/version_0/metrics.csv")


def assert_trains_finite(rows: list[dict[str, str]], steps: int) -> None:
    """Every training loss finite and not constant; validation and test values finite."""
    losses = [v for _, v in metric(rows, "train/loss_step")]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert len(set(losses)) > 1  # the optimizer stepped: it trains, not a constant
    for key in ("val/loss", "test/loss", "test/acc"):
        values = [v for _, v in metric(rows, key)]
        assert values and all(math.isfinite(v) for v in values), key


def stage_metrics(run_dir) -> dict[str, str]:
    """The ``test/*`` values of a run's metrics.csv."""
    rows = read_rows(run_dir / "metrics.csv")
    return {k: v for r in rows for k, v in r.items() if k.startswith("test/") and v}


def fit_on_two_then_test_on_one(tmp, base, data_dir, wandb_mode, fit_extra=()):
    """Fit (and test the best checkpoint) in 2 processes; test that checkpoint in 1."""
    common = [*base, "--data.data_dir", str(data_dir), "--runs_dir", str(tmp / "runs")]
    proc = run_cli(
        ["fit", *common, *ddp(2), *fit_extra, "--experiment", "ddp", "--wandb_mode", wandb_mode],
        cwd=tmp,
    )
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr, "not a 2-process run"
    fit_dir = tmp / "runs/ddp/version_0"
    best = next((fit_dir / "checkpoints").glob("best-*.ckpt"))
    run_cli(
        ["test", *common, *ddp(1), "--experiment", "one", "--wandb_mode", "disabled"]
        + ["--ckpt_path", str(best)],
        cwd=tmp,
    )
    return fit_dir, tmp / "runs/one/version_0"


class StateDump(L.Callback):
    """After every training batch, save this rank's random features, redraw indices,
    pre-SBN running statistics and a checksum of its batch to
    ``$DDP_PROBE_DIR/rank<r>.pt``."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def setup(self, trainer, pl_module, stage) -> None:
        # Runs before the strategy wraps the model. DDP's default broadcast of rank 0's
        # buffers before every forward would hide ranks drifting apart: switch it off,
        # so that only the package's own mechanisms keep the ranks in step.
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)
        if kwargs is not None:
            kwargs["broadcast_buffers"] = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        backends = random_feature_backends(pl_module)
        sbn = [m for m in pl_module.modules() if isinstance(m, PPSBNAttention) and m.pre]
        self.steps.append(
            {
                "step": trainer.global_step,
                "batch": int(batch["input_ids"].sum()) if "input_ids" in batch else 0,
                "features": [
                    {k: v.detach().clone() for k, v in b.state_dict().items()} for b in backends
                ],
                "sbn": [(m.running_mean.clone(), m.running_var.clone()) for m in sbn],
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(os.environ["DDP_PROBE_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, out / f"rank{trainer.global_rank}.pt")


class LocalLoss(L.Callback):
    """Each rank's own training loss and example count per step, saved to
    ``<out>/loss_rank<r>.pt``: what ``train/loss`` must average over ranks."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[tuple[int, float, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = int(batch["labels"].shape[0])
        self.steps.append((trainer.global_step - 1, float(outputs["loss"]), n))

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.out / f"loss_rank{trainer.global_rank}.pt")


class AmpProbe(L.Callback):
    """What mixed precision really did, saved to ``<out>/amp_rank<r>.pt``: per training
    step, the autocast state seen by the model's forward, the dtypes of ``q`` entering and
    of the output leaving each ppSBN wrapper (``"sbn"``) and each attention core inside
    (``"core"``), and the loss scale of the precision plugin's GradScaler (None without
    one)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []
        self._current: dict = {}

    def setup(self, trainer, pl_module, stage) -> None:
        from macformer_lit.attention import attention_cores

        def model_hook(module, args):
            self._current["autocast"] = (
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
            )

        def hook(kind):
            def record(module, args, output):
                # Training forwards only: AttentionTelemetry calls the cores again after
                # the step, in fp32 under no_grad, to measure their error.
                if torch.is_grad_enabled():
                    self._current.setdefault(kind, []).append((args[0].dtype, output.dtype))

            return record

        pl_module.model.register_forward_pre_hook(model_hook)
        for _, core in attention_cores(pl_module):
            core.register_forward_hook(hook("core"))
        for m in pl_module.modules():
            if isinstance(m, PPSBNAttention):
                m.register_forward_hook(hook("sbn"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._current = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._current["scale"] = None if scaler is None else float(scaler.get_scale())
        self._current["loss"] = float(outputs["loss"])
        self.steps.append(self._current)

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.steps, self.out / f"amp_rank{trainer.global_rank}.pt")


class RootDirProbe(L.Callback):
    """Each rank's ``trainer.default_root_dir`` at the start of training, written to
    ``<out>/root_rank<r>.txt``."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"root_rank{trainer.global_rank}.txt").write_text(trainer.default_root_dir)


class HangAtStep(L.Callback):
    """At the start of the batch that would make global step ``step + 1``, write
    ``marker`` and wait to be killed: a kill from outside then lands at a known point."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.marker.write_text(str(self.step))
            time.sleep(3600)


class StopAtStep(L.Callback):
    """Stop training once ``global_step`` reaches ``$STOP_AT_STEP`` (if set), like a job
    killed right after its checkpoint at that step boundary."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop = os.environ.get("STOP_AT_STEP")
        if stop and trainer.global_step >= int(stop):
            trainer.should_stop = True


def resume_callbacks(checkpoint_dir: Path) -> str:
    """Callbacks YAML for exact-resume runs: RNG states in checkpoints, the stop probe, and
    a ``last.ckpt`` written after every training step (see the report: the CLI's own
    ``last.ckpt`` is only refreshed when the monitored metric improves)."""
    return f"""trainer:
  callbacks:
    - class_path: macformer_lit.callbacks.distributed.RNGStateCheckpoint
    - class_path: ddp_probe.StopAtStep
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {checkpoint_dir}
        filename: last
        monitor: null
        save_top_k: 1
        every_n_train_steps: 1
        enable_version_counter: false
"""
