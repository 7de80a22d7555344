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

import torch
from ddp_probe import assert_trains_finite, ddp, rmfa_precision_run

STEPS = 6


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
        # GradScaler's initial scale is 2**16; it only halves on an overflow.
        assert step["scale"] is not None and step["scale"] >= 1.0
        assert math.isfinite(step["loss"])
    # The optimizer stepped (losses not constant): the scaler did not skip every step.
    assert_trains_finite(rows, STEPS)
