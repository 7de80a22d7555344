import csv as csv_module
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from macformer_lit.callbacks.nan_guard import NaNGuard
from macformer_lit.data.common import PadCollate, SequenceDataset
from macformer_lit.tasks import LitClassifier

BAD_STEP = 2


class PoisonedModel(LitClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == BAD_STEP else loss


class WatchBadStep(L.Callback):
    """Records whether the parameters changed during the poisoned step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == BAD_STEP:
            self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if hasattr(self, "before") and not hasattr(self, "changed"):
            self.changed = any(
                not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())
            )


def run(tmp_path, action, attention=None, logger=False):
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 12, (8,), generator=g).numpy() for _ in range(32)]
    data = DataLoader(
        SequenceDataset(seqs, [int(s[0]) % 3 for s in seqs]), batch_size=4, collate_fn=PadCollate(0)
    )
    model = PoisonedModel(
        vocab_size=12,
        num_classes=3,
        max_len=8,
        pad_id=0,
        d_model=16,
        num_heads=2,
        num_layers=1,
        ffn_dim=16,
        warmup_steps=1,
        weight_decay=0.1,
        attention=attention,
    )
    guard, watch = NaNGuard(action=action), WatchBadStep()
    trainer = L.Trainer(
        max_steps=5,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[guard, watch],
    )
    trainer.fit(model, data)
    return model, guard, watch, trainer


def test_stop_writes_forensics_and_names_them(tmp_path):
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2; forensics in"):
        run(tmp_path, "stop")
    folder = tmp_path / "nan_forensics" / "step2"
    report = json.loads((folder / "report.json").read_text())
    assert report["loss_finite"] is False and report["step"] == BAD_STEP
    assert any("backend" in name for name in report["attention"])
    assert torch.load(folder / "batch.pt")["input_ids"].shape == (4, 8)
    assert (folder / "checkpoint.ckpt").is_file()


def test_skip_leaves_weights_unchanged_on_the_bad_step_and_goes_on(tmp_path):
    model, guard, watch, trainer = run(tmp_path, "skip")
    assert trainer.global_step == 5
    assert guard.skipped == 1
    assert watch.changed is False
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_action_is_refused():
    with pytest.raises(ValueError, match="must be 'stop' or 'skip'"):
        NaNGuard(action="ignore")


def test_feature_backends_report_features_and_denominators_and_log_them(tmp_path):
    rmfa = {"name": "rmfa", "kernel": "exp", "num_features": 16, "pre_sbn": True}
    csv = L.pytorch.loggers.CSVLogger(tmp_path, name="", version="")
    with pytest.raises(FloatingPointError):
        run(tmp_path, "stop", attention=rmfa, logger=csv)
    report = json.loads((tmp_path / "nan_forensics/step2/report.json").read_text())
    core = report["attention"]["model.encoder.blocks.0.attn.backend.inner"]
    # Finite features from a finite forward: the NaN came from the loss.
    assert 0 < core["max_abs_feature_q"] < float("inf")
    assert 0 < core["max_abs_feature_k"] < float("inf")
    assert core["min_abs_denominator"] >= 0 and core["denominators_nonfinite"] == 0
    # 2 heads x 8 positions x 4 examples rows, some of RMF's signed estimates may be <= 0.
    assert 0 <= core["denominators_nonpositive"] <= 64
    # The ppSBN wrapper itself has no feature map.
    assert "max_abs_feature_q" not in report["attention"]["model.encoder.blocks.0.attn.backend"]
    csv.save()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv_module.DictReader(f) if r.get("nan_forensics/max_grad_norm")]
    assert len(rows) == 1 and rows[0]["step"] == str(BAD_STEP)
    key = "nan_forensics/model.encoder.blocks.0.attn.backend.inner/min_abs_denominator"
    assert float(rows[0][key]) == pytest.approx(core["min_abs_denominator"])


def test_diagnose_gives_the_denominators_of_the_forward():
    """Linear attention, φ = elu + 1: the denominators by hand, padded keys excluded."""
    import torch.nn.functional as F

    from macformer_lit.attention import build_attention

    torch.manual_seed(0)
    attn = build_attention("linear", head_dim=8, num_heads=2)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    phi_q, phi_k = F.elu(q) + 1, (F.elu(k) + 1) * mask[:, None, :, None]
    pairs = phi_q @ phi_k.transpose(-1, -2)  # (B, H, N, M)
    for causal in (False, True):
        if causal:
            pairs = pairs.tril()
        stats = attn.diagnose(q, k, v, key_padding_mask=mask, causal=causal)
        assert stats["min_abs_denominator"] == pytest.approx(float(pairs.sum(-1).min()), rel=1e-5)
        assert stats["max_abs_feature_q"] == pytest.approx(float(phi_q.max()), rel=1e-6)
        assert stats["denominators_nonpositive"] == stats["denominators_nonfinite"] == 0
