"""``--config trainer/bf16.yaml`` (bf16-mixed autocast) trains ListOps with RMFA (exp
kernel) and ppSBN under DDP on CPU without NaN: ppSBN and the feature maps compute in fp32
inside autocast. NaNGuard (``action: stop``, the default) would end the run at the first
non-finite loss or gradient."""

from __future__ import annotations

from ddp_probe import assert_trains_finite, ddp, rmfa_precision_run

STEPS = 6


def test_ddp_bf16_mixed_rmfa_ppsbn_trains_without_nan(tmp_path):
    bf16 = ("--config", "trainer/bf16.yaml", *ddp(2))
    proc, rows = rmfa_precision_run(tmp_path, "bf16", STEPS, *bf16)
    out = proc.stdout + proc.stderr
    assert "MEMBER: 2/2" in out and "bfloat16 Automatic Mixed Precision" in out
    assert_trains_finite(rows, STEPS)
