"""Throughput, training time and peak memory, logged once per training epoch.

- ``train/samples_per_sec``, ``train/tokens_per_sec``: over the time spent in training
  steps (forward, backward, optimiser; validation excluded); tokens are real, non-padded
  ones, counted from the batch's padding masks.
- ``train/time_sec``: cumulative training-step time of the run (kept across resumes in
  the checkpoint, the steps of an epoch stopped midway included), the number ``report``
  normalises to the softmax run.
- ``train/peak_gpu_mem_mb``: ``torch.cuda.max_memory_allocated`` since the epoch began,
  the max over ranks, and ``train/peak_gpu_mem_mb_rank{r}`` for every rank ``r`` (gathered
  from all ranks; rank 0 logs them). On CPU, ``train/peak_rss_mb`` and
  ``train/peak_rss_mb_rank{r}``: each process's peak resident set size so far.

A light replacement for ``DeviceStatsMonitor`` (docs/pitfalls.md §1).
"""

from __future__ import annotations

import resource
import sys
import time

import lightning as L
import torch


def count_tokens(batch) -> tuple[int, int]:
    """(examples, real tokens) in a batch dict of the project's formats."""
    if not isinstance(batch, dict):
        return 0, 0
    masks = [v for k, v in batch.items() if k.startswith("padding_mask") or k.endswith("_mask")]
    ids = [v for k, v in batch.items() if k.startswith("input_ids") or k.endswith("_ids")]
    tokens = sum(int(m.sum()) for m in masks) if masks else sum(t.numel() for t in ids)
    first = next(iter(batch.values()))
    return int(first.shape[0]), tokens


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class ThroughputMemoryMonitor(L.Callback):
    def __init__(self) -> None:
        self.total_time = 0.0
        self._epoch_time = 0.0
        self._epoch_counted = False  # _epoch_time already added to total_time
        self._batch_start = 0.0
        self._samples = 0
        self._tokens = 0

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._epoch_time, self._epoch_counted = 0.0, False
        self._samples = self._tokens = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._epoch_time += time.perf_counter() - self._batch_start
        samples, tokens = count_tokens(batch)
        self._samples += samples
        self._tokens += tokens

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._samples == 0:
            # An epoch with no batches (e.g. resumed right at its end): nothing measured.
            return
        self.total_time += self._epoch_time
        self._epoch_counted = True
        elapsed = max(self._epoch_time, 1e-9)
        pl_module.log(
            "train/samples_per_sec", self._samples / elapsed, sync_dist=True, reduce_fx="sum"
        )
        pl_module.log(
            "train/tokens_per_sec", self._tokens / elapsed, sync_dist=True, reduce_fx="sum"
        )
        pl_module.log("train/time_sec", self.total_time, sync_dist=True, reduce_fx="max")
        if pl_module.device.type == "cuda":
            key, peak = "train/peak_gpu_mem_mb", torch.cuda.max_memory_allocated(pl_module.device)
            peak /= 2**20
        else:
            key, peak = "train/peak_rss_mb", peak_rss_mb()
        # One all-gather (every rank takes part); the gathered values are the same on all
        # ranks, so they are logged without a further reduction.
        local = torch.tensor([peak], dtype=torch.float64, device=pl_module.device)
        per_rank = trainer.strategy.all_gather(local).reshape(-1).tolist()
        pl_module.log(key, max(per_rank))
        for rank, value in enumerate(per_rank):
            pl_module.log(f"{key}_rank{rank}", value)

    def state_dict(self) -> dict:
        # A checkpoint inside an epoch (a stop, a validation midway) counts that epoch's
        # steps so far: the resumed process adds only the steps it runs.
        pending = 0.0 if self._epoch_counted else self._epoch_time
        return {"total_time": self.total_time + pending}

    def load_state_dict(self, state_dict: dict) -> None:
        self.total_time = float(state_dict.get("total_time", 0.0))
