"""Run as a script (2 gloo processes, Lightning's subprocess launcher re-runs it per rank):
each rank builds its attention layers from its own seed, so their initial draws differ; the
features each rank holds when training starts are saved to ``<out>/rank<r>.pt`` beside the
draw it built (``FeatureRedraw.setup`` must have replaced it by rank 0's).
Usage: ``python ddp_redraw_probe.py <backend> <out>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from macformer_lit.attention import build_attention, random_feature_backends
from macformer_lit.callbacks.redraw import FeatureRedraw


def features(module):
    return [
        {k: v.detach().clone() for k, v in b.state_dict().items()}
        for b in random_feature_backends(module)
    ]


class Module(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3 * 16)
        self.attn = nn.ModuleList(
            [
                build_attention(name, head_dim=8, num_heads=2, num_features=16),
                build_attention(name, head_dim=8, num_heads=2, num_features=16, pre_sbn=True),
            ]
        )

    def training_step(self, batch, batch_idx):
        (x,) = batch
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return sum(a(q, k, v) for a in self.attn).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Dump(pl.Callback):
    def __init__(self, out: Path, built) -> None:
        self.out, self.built = out, built

    def setup(self, trainer, pl_module, stage) -> None:
        # DDP's broadcast of rank 0's buffers (when the shapes happen to agree) must not do
        # the callback's work.
        trainer.strategy._ddp_kwargs["broadcast_buffers"] = False

    def on_train_start(self, trainer, pl_module) -> None:
        state = {"built": self.built, "started": features(pl_module)}
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main(name: str, out: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(1000 + rank)  # deliberately different draws per rank
    module = Module(name)
    built = features(module)
    data = torch.utils.data.TensorDataset(torch.randn(8, 6, 8))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FeatureRedraw(), Dump(Path(out), built)],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
