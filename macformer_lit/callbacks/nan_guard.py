"""NaN forensics: on a non-finite loss or gradient, record what led there, then stop or skip.

On the first non-finite training loss or gradient it writes, under
``<run_dir>/nan_forensics/step<k>/``:

- ``report.json``: the step, which of loss / gradients was non-finite, per-parameter
  gradient norms (non-finite ones named first), and per attention layer the largest
  |q|, |k|, |v| entry and the q·k/√d range of the last forward pass; for feature-map
  backends (rmfa, favor, linear) also the largest |feature| of queries and keys and the
  smallest |denominator| (``FeatureAttention.diagnose`` rerun on that pass's inputs);
- the same per-layer numbers and the largest gradient norm, logged to every logger under
  ``nan_forensics/<layer>/<name>`` at that step;
- ``batch.pt``: the offending batch (tensors, on CPU);
- ``checkpoint.ckpt``: the model and optimiser state before the bad update.

``action: stop`` (default) ends training with a message naming that folder;
``action: skip`` drops the gradients so the optimiser step changes nothing, logs
``train/skipped_steps``, and goes on (forensics are written for the first
``max_reports`` bad steps only).

Under a dynamic loss scale (``16-mixed``: a ``GradScaler`` in the precision plugin), inf or
NaN gradients with a finite loss are the scaler's ordinary overflow: it skips that step and
halves its scale, so the guard lets it (and logs ``train/overflow_steps`` and
``train/loss_scale``). It still acts on a non-finite loss, and on a scale that has collapsed
below ``min_loss_scale`` (1, DeepSpeed's default floor): gradients that overflow float16 even
unscaled, which more halving cannot cure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import lightning as L
import torch

from macformer_lit.attention.base import AttentionBackend


class NaNGuard(L.Callback):
    def __init__(
        self,
        *,
        action: Literal["stop", "skip"] = "stop",
        max_reports: int = 3,
        min_loss_scale: float = 1.0,
    ) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"NaNGuard action must be 'stop' or 'skip'; got {action!r}")
        if not min_loss_scale > 0:
            raise ValueError(f"NaNGuard min_loss_scale must be > 0; got {min_loss_scale}")
        self.action = action
        self.max_reports = max_reports
        self.min_loss_scale = min_loss_scale
        self.skipped = 0
        self.overflows = 0
        self.reports = 0
        self._batch = None
        self._loss_bad = False
        self._collapsed: float | None = None
        self._stats: dict[str, dict[str, float]] = {}
        self._handles: list = []
        self._inputs: dict[str, tuple] = {}

    # ---- attention inputs, captured by forward hooks (no model changes) --------------
    def setup(self, trainer, pl_module, stage) -> None:
        for name, module in pl_module.named_modules():
            if isinstance(module, AttentionBackend):
                self._handles.append(
                    module.register_forward_hook(self._hook(name), with_kwargs=True)
                )

    def teardown(self, trainer, pl_module, stage) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs.clear()

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            if not module.training or len(args) < 3:
                return
            q, k, v = (t.detach() for t in args[:3])
            d = q.shape[-1]
            # A corner of the score matrix is enough to see the range blow up.
            s = q[..., :64, :].float() @ k[..., :64, :].float().transpose(-1, -2) / math.sqrt(d)
            self._stats[name] = {
                "max_abs_q": q.abs().max().item(),
                "max_abs_k": k.abs().max().item(),
                "max_abs_v": v.abs().max().item(),
                "qk_min": s.min().item(),
                "qk_max": s.max().item(),
                "output_finite": bool(torch.isfinite(output).all()),
            }
            if type(module).diagnose is not AttentionBackend.diagnose:
                # Kept until the next forward (autograd holds these tensors until backward
                # anyway); features and denominators are only computed after a failure.
                mask = kwargs.get("key_padding_mask")
                causal = bool(kwargs.get("causal", False))
                self._inputs[name] = (module, q, k, v, mask, causal)

        return hook

    # ---- detection -------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._loss_bad = not bool(torch.isfinite(loss.detach()).all())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        bad_grads = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        if not (self._loss_bad or bad_grads):
            return
        scaler = _live_scaler(trainer)
        if scaler is not None and not self._loss_bad:
            # The scaler saw the same inf/NaN when it unscaled: it will skip this step and
            # lower its scale. A failure only once the scale is past saving.
            scale = float(scaler.get_scale())
            self.overflows += 1
            pl_module.log("train/overflow_steps", float(self.overflows), on_step=True)
            pl_module.log("train/loss_scale", scale, on_step=True)
            if scale >= self.min_loss_scale:
                return
            self._collapsed = scale
        folder = None
        if self.reports < self.max_reports:
            folder = self._write(trainer, pl_module, grads, bad_grads)
            self.reports += 1
        what = "loss" if self._loss_bad else f"gradients of {len(bad_grads)} parameter(s)"
        if self._collapsed is not None:
            what += (
                f" with the loss scale collapsed to {self._collapsed:g} (below min_loss_scale "
                f"{self.min_loss_scale:g}: float16 keeps overflowing; try bf16-mixed)"
            )
            self._collapsed = None
        if self.action == "stop":
            trainer.should_stop = True
            raise FloatingPointError(
                f"non-finite {what} at step {trainer.global_step}; forensics in {folder}. "
                "Set the NaNGuard action to 'skip' to skip such steps instead."
            )
        # With every grad None, torch optimisers skip the parameters entirely: no update,
        # no weight decay, no change to the moment estimates.
        optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        pl_module.log("train/skipped_steps", float(self.skipped), on_step=True)

    def _write(self, trainer, pl_module, grads, bad_grads) -> Path:
        for name, (module, q, k, v, mask, causal) in self._inputs.items():
            try:
                self._stats[name].update(
                    module.diagnose(q, k, v, key_padding_mask=mask, causal=causal)
                )
            except Exception as err:  # forensics must not hide the original failure
                self._stats[name]["diagnose_error"] = repr(err)
        self._log_stats(trainer, grads)
        root = Path(trainer.default_root_dir or ".")
        folder = root / "nan_forensics" / f"step{trainer.global_step}"
        if trainer.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            norms = {n: float(g.float().norm()) for n, g in grads.items()}
            report = {
                "step": trainer.global_step,
                "loss_finite": not self._loss_bad,
                "non_finite_grads": bad_grads,
                # Non-finite norms first, then the largest.
                "grad_norms": dict(
                    sorted(norms.items(), key=lambda kv: (math.isfinite(kv[1]), -abs(kv[1])))
                ),
                "attention": self._stats,
            }
            (folder / "report.json").write_text(json.dumps(report, indent=2, default=str))
            batch = self._batch
            if isinstance(batch, dict):
                batch = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            torch.save(batch, folder / "batch.pt")
        trainer.save_checkpoint(folder / "checkpoint.ckpt", weights_only=False)
        return folder

    def _log_stats(self, trainer, grads) -> None:
        metrics = {
            f"nan_forensics/{layer}/{key}": float(value)
            for layer, stats in self._stats.items()
            for key, value in stats.items()
            if isinstance(value, (int, float))
        }
        norms = [float(g.float().norm()) for g in grads.values()]
        if norms:
            metrics["nan_forensics/max_grad_norm"] = max(norms)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "overflows": self.overflows}

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.overflows = int(state_dict.get("overflows", 0))


def _live_scaler(trainer):
    """The precision plugin's enabled ``GradScaler`` (``16-mixed``), else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None
