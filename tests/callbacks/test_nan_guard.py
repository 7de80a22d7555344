import csv as csv_module
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from macformer_lit.attention.reference import rmf_features
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


def run(tmp_path, action, attention=None, logger=False, callbacks=()):
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
        callbacks=[guard, watch, *callbacks],
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


class CaptureCore(L.Callback):
    """The inputs of the RMFA core (inside pre-SBN) in the training forward of BAD_STEP."""

    def setup(self, trainer, pl_module, stage):
        inner = pl_module.model.encoder.blocks[0].attn.backend.inner

        def hook(module, args, kwargs, output):
            if module.training and trainer.global_step == BAD_STEP:
                q, k = (t.detach().clone() for t in args[:2])
                self.inputs = (module, q, k, kwargs.get("key_padding_mask"))

        inner.register_forward_hook(hook, with_kwargs=True)


def test_feature_backends_report_features_and_denominators_and_log_them(tmp_path):
    rmfa = {"name": "rmfa", "kernel": "exp", "num_features": 16, "pre_sbn": True}
    csv = L.pytorch.loggers.CSVLogger(tmp_path, name="", version="")
    capture = CaptureCore()
    with pytest.raises(FloatingPointError):
        run(tmp_path, "stop", attention=rmfa, logger=csv, callbacks=[capture])
    report = json.loads((tmp_path / "nan_forensics/step2/report.json").read_text())
    core = report["attention"]["model.encoder.blocks.0.attn.backend.inner"]
    # Finite features from a finite forward: the NaN came from the loss.
    assert 0 < core["max_abs_feature_q"] < float("inf")
    assert 0 < core["max_abs_feature_k"] < float("inf")
    assert core["min_abs_denominator"] >= 0 and core["denominators_nonfinite"] == 0
    # The denominators φ(q_i)·Σ_j φ(k_j) recomputed in float64 with the reference feature
    # map on the core's inputs of the bad step: 2 heads x 8 positions x 4 examples.
    inner, q, k, mask = capture.inputs
    s = inner.head_dim**-0.25
    phi_q, phi_k = (rmf_features(inner, x.double() * s) for x in (q, k))
    if mask is not None:
        phi_k = phi_k * mask[:, None, :, None]
    den = (phi_q * phi_k.sum(2, keepdim=True)).sum(-1)
    assert den.numel() == 64
    # None so close to 0 that float32 rounding could flip its sign: the count is exact.
    assert float(den.abs().min()) > 1e-3 * float(den.abs().max())
    # After pre-SBN every denominator is near a₀·n = 8 (6.7 to 9.2 here): none is ≤ 0; signed
    # ones are counted in test_diagnose_counts_the_signed_denominators_of_bare_rmfa.
    assert core["denominators_nonpositive"] == int((den <= 0).sum()) == 0
    assert core["min_abs_denominator"] == pytest.approx(float(den.abs().min()), rel=1e-5)
    # Every number in the report is the core's diagnose of exactly those inputs (JSON keeps
    # floats exactly): the guard read the bad step's forward, not another one.
    again = inner.diagnose(q, k, k, key_padding_mask=mask, causal=False)
    assert {key: core[key] for key in again} == again
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


def test_diagnose_counts_the_signed_denominators_of_bare_rmfa():
    """Without pre-SBN, RMF's signed estimates of the denominator go ≤ 0: the count against the
    float64 reference feature map (diagnose works in the forward's rescaled feature space,
    a positive constant per (batch, head) that keeps every sign but not the magnitude)."""
    from macformer_lit.attention import build_attention

    torch.manual_seed(2)
    # Measured on this draw: 18 non-positive of 48 denominators, 22 when causal. Pinned so the
    # test is known to count some signed rows and not all (and shows a changed draw).
    nonpositive = {False: 18, True: 22}
    attn = build_attention("rmfa", head_dim=8, num_heads=2, num_features=16)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[True] * 12, [True] * 9 + [False] * 3])
    s = 8**-0.25
    phi_q, phi_k = (rmf_features(attn, x.double() * s) for x in (q, k))
    phi_k = phi_k * mask[:, None, :, None]
    for causal in (False, True):
        sums = phi_k.cumsum(2) if causal else phi_k.sum(2, keepdim=True)
        den = (phi_q * sums).sum(-1)
        assert float(den.abs().min()) > 1e-4 * float(den.abs().max())  # no sign within rounding
        stats = attn.diagnose(q, k, v, key_padding_mask=mask, causal=causal)
        assert den.numel() == 48  # 2 examples x 2 heads x 12 positions
        assert stats["denominators_nonpositive"] == int((den <= 0).sum()) == nonpositive[causal]
