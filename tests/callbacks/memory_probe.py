"""Train a small RMFA + ppSBN classifier through a real Trainer on batches whose length
changes every step (as length-bucketed batches do), and print, as JSON, the resident size
and the peak resident size (MB) at the end of every epoch.

    python memory_probe.py MULTIPLE EVERY_N_STEPS EPOCHS

Batches are padded to a multiple of MULTIPLE tokens (as ``pad_to_multiple_of``);
EVERY_N_STEPS < 0 leaves the ReleaseHostMemory callback out. Run in a fresh process so that
the C heap starts empty.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from macformer_lit.callbacks.memory import ReleaseHostMemory
from macformer_lit.callbacks.monitor import peak_rss_mb
from macformer_lit.data.common import padded_length
from macformer_lit.tasks import LitClassifier

BATCH, STEPS_PER_EPOCH, MIN_LEN, MAX_LEN = 16, 12, 64, 1536


def batches(seed: int, multiple: int) -> list[dict[str, torch.Tensor]]:
    """One epoch of batches, each of a length of its own (new lengths every epoch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS_PER_EPOCH):
        longest = int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=g))
        n = padded_length(longest, multiple, MAX_LEN)
        lengths = torch.randint(longest // 2, longest + 1, (BATCH,), generator=g)
        mask = torch.arange(n)[None] < lengths[:, None]
        ids = torch.randint(1, 16, (BATCH, n), generator=g).masked_fill(~mask, 0)
        labels = torch.randint(0, 10, (BATCH,), generator=g)
        out.append({"input_ids": ids, "padding_mask": mask, "labels": labels})
    return out


class Epochs(torch.utils.data.IterableDataset):
    def __init__(self, multiple: int) -> None:
        self.epoch, self.multiple = 0, multiple

    def __iter__(self):
        self.epoch += 1
        return iter(batches(self.epoch, self.multiple))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PerEpoch(L.Callback):
    """Resident size at each epoch's end (after the other callbacks) and the peak so far."""

    def __init__(self) -> None:
        self.start = 0.0
        self.rss: list[float] = []
        self.peak: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = rss_mb()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.rss.append(rss_mb())
        self.peak.append(peak_rss_mb())


def main(multiple: int, every_n_steps: int, epochs: int) -> None:
    torch.manual_seed(0)
    model = LitClassifier(
        vocab_size=16,
        num_classes=10,
        max_len=MAX_LEN,
        pad_id=0,
        warmup_steps=1,
        attention=dict(name="rmfa", kernel="exp", num_features=128, pre_sbn=True, post_sbn=True),
    )
    probe = PerEpoch()
    release = [ReleaseHostMemory(every_n_steps)] if every_n_steps >= 0 else []
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*release, probe],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=DataLoader(Epochs(multiple), batch_size=None))
    print(json.dumps({"start": probe.start, "rss": probe.rss, "peak": probe.peak}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
