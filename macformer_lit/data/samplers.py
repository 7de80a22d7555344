"""Samplers and a DataLoader for exact distributed evaluation and exact resume.

- ``EpochRandomSampler``: a shuffle that is a pure function of ``(seed, epoch)``, like
  ``DistributedSampler``'s, instead of ``RandomSampler``'s draw from the global RNG: a run
  resumed in epoch e sees epoch e's order again. Being a ``RandomSampler``, Lightning still
  recognises it as shuffled and swaps in its ``DistributedSampler`` under DDP.
- ``eval_sampler``: evaluation order over one rank's shard, never repeating an example.
  Lightning's ``DistributedSampler`` pads every shard to the same length by repeating
  examples, which changes test metrics (``UnrepeatedDistributedSampler`` is Lightning's own
  sampler for prediction; ranks may then run one batch fewer, which evaluation allows
  because nothing synchronises per batch).
- ``ResumableDataLoader``: counts the batches of the current pass; Lightning 2.6 saves
  ``state_dict()`` of such a loader in the checkpoint (``fit_loop``'s ``combined_loader``)
  and calls ``load_state_dict`` before iterating again, so a run resumed mid-epoch skips
  the batches it had already trained on, at the index level without loading them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler
from torch.utils.data import SequentialSampler as _Sequential


def world() -> tuple[int, int]:
    """``(world size, rank)`` of the initialised process group, or ``(1, 0)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class EpochRandomSampler(RandomSampler):
    """A permutation of the data set seeded by ``(seed, epoch)``; ``set_epoch`` moves on."""

    def __init__(self, data_source: Sized, *, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())


def eval_sampler(ds: Sized) -> Sampler[int]:
    """Sequential order over this rank's share of ``ds``, each example on exactly one rank."""
    size, rank = world()
    if size == 1:
        return _Sequential(ds)
    if 0 < len(ds) < size:
        # A rank without a batch would skip the metric syncs the others wait in.
        raise ValueError(
            f"an evaluation split of {len(ds)} example(s) cannot be shared by {size} processes: "
            f"each needs at least one; run it on at most {len(ds)} device(s), or use a larger "
            "split"
        )
    return UnrepeatedDistributedSampler(ds, num_replicas=size, rank=rank, shuffle=False)


def unrepeated(sampler: Sampler[int]) -> Sampler[int]:
    """``sampler`` itself, unless it is a padding ``DistributedSampler`` without shuffling
    (what Lightning injects into an evaluation batch sampler under DDP): then the same
    shard without the padding."""
    if (
        isinstance(sampler, DistributedSampler)
        and not isinstance(sampler, UnrepeatedDistributedSampler)
        and not sampler.shuffle
    ):
        return UnrepeatedDistributedSampler(
            sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=False
        )
    return sampler


class _Skipping:
    """The loader's index sampler, skipping the first batches of the pass being started."""

    def __init__(self, inner, loader: ResumableDataLoader) -> None:
        self.inner, self.loader = inner, loader

    def __iter__(self):
        return itertools.islice(iter(self.inner), self.loader._pass_skip, None)

    def __len__(self) -> int:
        return len(self.inner)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position in the current pass is part of the checkpoint."""

    _skip = 0  # batches to skip at the start of the next pass (set by load_state_dict)
    _pass_skip = 0  # ... of the pass being started, while its iterator is built
    _position = 0

    @property
    def _index_sampler(self):
        # DataLoader iterators keep this object and iterate it at every (re)start, more
        # than once when starting workers, and across passes with persistent workers.
        return _Skipping(super()._index_sampler, self)

    def __iter__(self):
        self._pass_skip, self._skip = self._skip, 0
        self._position = self._pass_skip
        try:
            batches = super().__iter__()
        finally:
            self._pass_skip = 0
        for batch in batches:
            self._position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        # A finished pass resumes at the start of the next one.
        return {"batches": self._position % max(len(self), 1)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state.get("batches", 0))
