"""Redraw the random features of every attention layer on a schedule (docs/maths.md §5.6).

Training-time side effects live in callbacks, not in ``forward`` (docs/architecture.md §9; the
counter-example is performer-pytorch redrawing inside forward). Layer i's draw number r
comes from a generator seeded by (seed, i, r), so every rank and every resumed run draws
the same features with no broadcast; r follows from the trainer's progress (step // n or
epoch), and a backend already holding draw r (``redraw_index``, saved in checkpoints) is
left alone. Features drawn at construction (torch's global RNG, like the weights) serve
until the first redraw; at setup, rank 0 broadcasts them, so ranks agree even when the
model was built without a common seed (a draw's shape is random, and DDP's own buffer
broadcast needs equal shapes). Evaluation never redraws.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from macformer_lit.attention import random_feature_backends


class FeatureRedraw(Callback):
    def __init__(
        self,
        *,
        policy: Literal["never", "steps", "epoch"] = "never",
        every_n_steps: int = 1000,
        seed: int = 0,
    ) -> None:
        if policy not in ("never", "steps", "epoch"):
            raise ValueError(f"redraw policy must be never, steps or epoch; got {policy!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1; got {every_n_steps}")
        self.policy, self.every_n_steps, self.seed = policy, every_n_steps, seed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Runs after the process group exists and before DDP wraps the model.
        if trainer.world_size > 1:
            for backend in random_feature_backends(pl_module):
                draw = {key: value.cpu() for key, value in backend.state_dict().items()}
                backend.load_state_dict(trainer.strategy.broadcast(draw, src=0))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.policy == "steps" and step > 0 and step % self.every_n_steps == 0:
            self.redraw(pl_module, step // self.every_n_steps)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.policy == "epoch" and trainer.current_epoch > 0:
            self.redraw(pl_module, trainer.current_epoch)

    def redraw(self, pl_module: pl.LightningModule, index: int) -> int:
        """Give every random-feature layer draw ``index``; returns how many changed."""
        if not pl_module.training:
            return 0
        changed = 0
        for layer, backend in enumerate(random_feature_backends(pl_module)):
            if int(backend.redraw_index) != index:
                backend.redraw_features(seed=self.seed, layer=layer, index=index)
                changed += 1
        return changed
