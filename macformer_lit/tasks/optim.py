"""AdamW with linear warm-up then linear decay to zero (the LRA / Skyformer schedule)."""

from __future__ import annotations

import torch
from torch import nn


def adamw_warmup_linear(
    module: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    warmup_steps: int,
    total_steps: int,
) -> dict:
    """Optimizer config for ``configure_optimizers``; the schedule steps every batch.

    Biases, norms and embeddings get no weight decay. A parameter carrying an ``_optim``
    dict (``{"lr": ..., "weight_decay": ...}``, as S4 and Mamba mark theirs; ppSBN's
    temperature) gets a group of its own with those settings, scheduled like the rest.
    """
    decay, no_decay = [], []
    own: dict[tuple, list] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "_optim"):
            own.setdefault(tuple(sorted(p._optim.items())), []).append(p)
            continue
        is_matrix = p.dim() >= 2 and "emb" not in name
        (decay if is_matrix else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            *({"params": ps, **dict(key)} for key, ps in own.items()),
        ],
        lr=lr,
        betas=betas,
        eps=eps,
    )
    total_steps = max(total_steps, warmup_steps + 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / (total_steps - warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"},
    }


def check_optim_args(*, lr: float, weight_decay: float, warmup_steps: int) -> None:
    if lr <= 0:
        raise ValueError(f"lr must be positive; got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0; got {warmup_steps}")
