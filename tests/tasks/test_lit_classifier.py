import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from macformer_lit.data.common import PadCollate, SequenceDataset
from macformer_lit.tasks import LitClassifier
from macformer_lit.tasks.optim import adamw_warmup_linear


def toy_loader(n, seed, batch_size=16, shuffle=False):
    # Label = first token mod 3: learnable in a few dozen steps.
    g = torch.Generator().manual_seed(seed)
    seqs = [
        torch.randint(1, 12, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).numpy()
        for _ in range(n)
    ]
    labels = [int(s[0]) % 3 for s in seqs]
    return DataLoader(
        SequenceDataset(seqs, labels),
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=PadCollate(0),
    )


def test_lit_classifier_learns_a_toy_task():
    L.seed_everything(0)
    model = LitClassifier(
        vocab_size=12,
        num_classes=3,
        max_len=16,
        pad_id=0,
        d_model=32,
        num_heads=2,
        num_layers=1,
        ffn_dim=64,
        dropout=0.0,
        lr=3e-3,
        warmup_steps=5,
        pooling="cls",
    )
    trainer = L.Trainer(
        max_steps=120,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model, toy_loader(256, 0, shuffle=True), toy_loader(64, 1))
    assert set(trainer.callback_metrics) >= {"train/loss", "val/loss", "val/acc"}
    (result,) = trainer.test(model, toy_loader(128, 2), verbose=False)
    # Chance is about 1/3; the rule is exact, so a working model is far above it.
    assert result["test/acc"] > 0.8
    # The majority-class share of each split, counted from its labels.
    (validated,) = trainer.validate(model, toy_loader(64, 1), verbose=False)
    for stage, loader, metrics in (
        ("val", toy_loader(64, 1), validated),
        ("test", toy_loader(128, 2), result),
    ):
        labels = torch.cat([b["labels"] for b in loader])
        share = float(torch.bincount(labels).max() / labels.numel())
        assert float(metrics[f"{stage}/majority_acc"]) == pytest.approx(share)


def test_schedule_warms_up_then_decays_to_zero():
    opt = adamw_warmup_linear(
        torch.nn.Linear(2, 2),
        lr=1.0,
        weight_decay=0.1,
        betas=(0.9, 0.999),
        eps=1e-6,
        warmup_steps=4,
        total_steps=12,
    )
    sched = opt["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(12):
        lrs.append(sched.get_last_lr()[0])
        opt["optimizer"].step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])


def test_bad_optimiser_settings():
    with pytest.raises(ValueError, match="lr must be positive"):
        LitClassifier(vocab_size=12, num_classes=3, max_len=16, pad_id=0, lr=0.0)
