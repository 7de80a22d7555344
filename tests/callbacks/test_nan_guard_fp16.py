"""NaNGuard under a dynamic loss scale, through Lightning's real ``MixedPrecision`` plugin.

``16-mixed`` on a GPU scales the loss with a ``GradScaler``; an overflow (inf gradients, finite
loss) is routine: the scaler skips that step and halves its scale. The guard runs after the
scaler has unscaled, so it sees those inf gradients too; it must leave them to the scaler and
still stop on a non-finite loss or a collapsed scale. ``MixedPrecision("16-mixed", "cpu")``
gives the same machinery on the CPU (float16 autocast and a CPU ``GradScaler``). Overflows
are forced by multiplying a finite loss by 1e30: finite in float32 even after scaling by
2**16, but its gradients overflow float16 inside the autocast layers.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from macformer_lit.callbacks.nan_guard import NaNGuard
from macformer_lit.data.common import PadCollate, SequenceDataset
from macformer_lit.tasks import LitClassifier

INITIAL_SCALE = 2.0**16  # GradScaler's default; it grows only after 2000 clean steps


class Poisoned(LitClassifier):
    """Multiplies the loss by ``factor`` from step ``first`` on (``every``) or at it only."""

    def __init__(self, *, first: int, factor: float, every: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.first, self.factor, self.every = first, factor, every

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        hit = self.global_step >= self.first if self.every else self.global_step == self.first
        return loss * self.factor if hit else loss


class Trace(L.Callback):
    """Per step: the scale before it, and whether it changed the parameters."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.changed.append(
            any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters()))
        )


def fit(tmp_path, *, first, factor, every=False, steps=5, **guard):
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 12, (8,), generator=g).numpy() for _ in range(64)]
    data = DataLoader(
        SequenceDataset(seqs, [int(s[0]) % 3 for s in seqs]), batch_size=4, collate_fn=PadCollate(0)
    )
    model = Poisoned(
        first=first,
        factor=factor,
        every=every,
        vocab_size=12,
        num_classes=3,
        max_len=8,
        pad_id=0,
        d_model=16,
        num_heads=2,
        num_layers=1,
        ffn_dim=16,
        warmup_steps=1,
    )
    nan_guard, trace = NaNGuard(**guard), Trace()
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", device="cpu")],
        callbacks=[nan_guard, trace],
    )
    trainer.fit(model, data)
    return trainer, nan_guard, trace


def test_an_overflow_is_left_to_the_scaler(tmp_path):
    trainer, nan_guard, trace = fit(tmp_path, first=2, factor=1e30)
    assert trainer.global_step == 5
    # The scale halves once, at the overflow, and the overflow step changes no weight while
    # every other step does.
    h = INITIAL_SCALE
    assert trace.scales == [h, h, h, h / 2, h / 2]
    assert trace.changed == [True, True, False, True, True]
    assert nan_guard.overflows == 1 and nan_guard.reports == 0
    assert not (tmp_path / "nan_forensics").exists()


def test_a_collapsed_scale_stops_the_run(tmp_path):
    # Every step from 1 on overflows: the scale halves each time; the guard stops at the
    # first step whose scale is below the floor (2**16 / 8 = 8192 < 2**14).
    message = r"collapsed to 8192 \(below min_loss_scale 16384: .* at step 4; "
    with pytest.raises(FloatingPointError, match=message):
        fit(tmp_path, first=1, factor=1e30, every=True, steps=8, min_loss_scale=2.0**14)
    assert (tmp_path / "nan_forensics" / "step4" / "report.json").is_file()


def test_a_non_finite_loss_still_stops_under_the_scaler(tmp_path):
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2; forensics in"):
        fit(tmp_path, first=2, factor=float("nan"))


def test_the_forced_overflow_reaches_the_guard(tmp_path):
    """With no scale good enough, the same overflow stops the run: the poisoned step really
    puts inf gradients in front of the guard (what a guard blind to the scaler stopped on)."""
    with pytest.raises(FloatingPointError, match="non-finite gradients of"):
        fit(tmp_path, first=2, factor=1e30, min_loss_scale=float("inf"))


def test_min_loss_scale_must_be_positive():
    with pytest.raises(ValueError, match="min_loss_scale must be > 0"):
        NaNGuard(min_loss_scale=0)
