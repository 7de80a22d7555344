"""``16-mixed`` for real on a CPU: float16 autocast with a dynamic loss scale.

Lightning turns ``precision: 16-mixed`` on a CPU into bf16-mixed, so the GPU path
(``configs/trainer/fp16.yaml``) cannot run here as such. Passing Lightning's own
``MixedPrecision("16-mixed", device="cpu")`` plugin gives the same machinery on the CPU:
``torch.autocast(dtype=float16)`` around every step and a ``torch.amp.GradScaler`` that
scales the loss and unscales before clipping. RMFA (exp kernel) with ppSBN must train
without NaN under it, the attention cores computing in fp32 inside ppSBN (which takes and
returns float16), and the scaler must be live.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from ddp_probe import assert_trains_finite, ddp, metric, rmfa_precision_run

STEPS = 6
OVERFLOW_AT = 2  # the batch that makes global step 3


class ForcedOverflow(L.Callback):
    """Importable by the CLI subprocess (this folder is on its PYTHONPATH). At global step
    ``at``, after backward and before the scaler unscales, one gradient entry becomes inf:
    an overflow with a finite loss, as fp16 produces on a GPU. Per step, saves to
    ``<out>/trace.pt`` whether the parameters changed."""

    def __init__(self, at: int, out: str) -> None:
        self.at, self.out = at, Path(out)
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.at:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = (
                math.inf
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        after = list(pl_module.parameters())
        self.changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, after)))

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.changed, self.out / "trace.pt")


def test_fp16_autocast_with_grad_scaler_trains_rmfa_ppsbn_without_nan(tmp_path):
    plugin = tmp_path / "fp16_cpu.yaml"
    plugin.write_text(
        "trainer:\n"
        "  plugins:\n"
        "    - class_path: lightning.pytorch.plugins.precision.MixedPrecision\n"
        "      init_args: {precision: 16-mixed, device: cpu}\n"
        "  callbacks:\n"
        "    - class_path: ddp_probe.AmpProbe\n"
        f"      init_args: {{out: {tmp_path / 'probe'}}}\n"
        "    - class_path: test_fp16_mixed.ForcedOverflow\n"
        f"      init_args: {{at: {OVERFLOW_AT}, out: {tmp_path / 'probe'}}}\n"
    )
    _, rows = rmfa_precision_run(tmp_path, "fp16", STEPS, "--config", str(plugin), *ddp(1))
    steps = torch.load(tmp_path / "probe/amp_rank0.pt")
    assert len(steps) == STEPS
    for step in steps:
        assert step["autocast"] == (True, torch.float16)
        # ppSBN takes float16 q from the autocast projections and returns float16; the
        # core inside it (the feature maps and their sums) gets and gives fp32.
        assert len(step["sbn"]) == len(step["core"]) > 0
        assert set(step["sbn"]) == {(torch.float16, torch.float16)}
        assert set(step["core"]) == {(torch.float32, torch.float32)}
        assert math.isfinite(step["loss"])
    # GradScaler starts at 2**16, grows only after 2000 clean steps and halves on an overflow:
    # exactly once here, at the forced one (the scale is read after each step's update).
    h = 2.0**16
    assert [step["scale"] for step in steps] == [h, h, h / 2, h / 2, h / 2, h / 2]
    # The overflow step is skipped (no weight moves); every other step moves the weights.
    changed = torch.load(tmp_path / "probe/trace.pt")
    assert changed == [step != OVERFLOW_AT for step in range(STEPS)]
    # NaNGuard (on by default) left the overflow to the scaler and counted it: first logged at
    # the overflow step, the running count stays 1 after it.
    overflows = metric(rows, "train/overflow_steps")
    assert overflows[0] == (OVERFLOW_AT, 1.0) and {v for _, v in overflows} == {1.0}
    assert_trains_finite(rows, STEPS)
