"""Pieces every DataModule shares: errors, padding, bucketing, sizes, loaders, base classes.

Batch format for single-sequence tasks (ListOps, Text, Image, Pathfinder):

    {"input_ids": (B, L) long, "padding_mask": (B, L) bool, True = real, "labels": (B,) long}

Batches are padded to their own longest sequence rounded up to a multiple of
``pad_to_multiple_of`` tokens (64 by default, never beyond ``max_len``), optionally with
length-bucketed sampling so that sequences of similar length share a batch. The rounding
bounds the number of batch shapes a long run meets (about ``max_len / 64``): with a new
shape at nearly every step the C heap fragments and the process grows until it is killed
(``callbacks/memory.py`` has the measurements). Padding never changes a prediction: every
model masks it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from .samplers import (
    EpochRandomSampler,
    ResumableDataLoader,
    eval_sampler,
    unrepeated,
    world,
)

# Generated files are written whole (staging.py); re-exported for the DataModules.
from .staging import remove_stale_temporaries, staging_path, write_whole  # noqa: E402, F401


class MissingDataError(FileNotFoundError):
    """Data files are not where the DataModule looks; the message says how to get them."""

    def __init__(self, what: str, missing: Sequence[Path | str], how_to_get: str) -> None:
        listed = "\n".join(f"  - {p}" for p in missing)
        super().__init__(f"{what}: missing file(s)\n{listed}\n{how_to_get}")


class DataFormatError(ValueError):
    """A data file is malformed; the message names the file and line."""

    def __init__(self, path: Path | str, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")


def check_not_empty(count: int, split: str, source: Path | str) -> None:
    """A split without examples (a file holding its header only, an empty folder) is named
    here, before any sampler or metric meets it."""
    if count == 0:
        raise DataFormatError(
            source,
            None,
            f"the {split} split holds no examples; regenerate or re-download the data, or "
            "point --data.data_dir at a complete copy",
        )


def splits_for(stage: str | None, *, test_at_fit: bool = False) -> tuple[str, ...]:
    """The splits ``setup(stage)`` loads. ``test_at_fit``: ``fit`` loads the test split too,
    so that a test split without examples stops the run before training, not after it
    (the CLI sets it when ``fit`` tests the best checkpoint afterwards)."""
    return {
        "fit": ("train", "val", "test") if test_at_fit else ("train", "val"),
        "validate": ("val",),
        "test": ("test",),
        "predict": ("test",),
    }.get(stage or "", ("train", "val", "test"))


def check_positive(name: str, value: int | None, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def check_loader_args(
    *,
    batch_size: int,
    eval_batch_size: int | None,
    num_workers: int,
    sizes: tuple[int | None, int | None, int | None],
) -> None:
    """The checks every DataModule makes of its loader settings and split sizes."""
    check_positive("batch_size", batch_size, allow_none=False)
    check_positive("eval_batch_size", eval_batch_size)
    for name, value in zip(("train_size", "val_size", "test_size"), sizes):
        check_positive(name, value)
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0; got {num_workers}")


class SequenceDataset(Dataset):
    """Token sequences (numpy int arrays) with integer labels."""

    def __init__(self, sequences: Sequence[np.ndarray], labels: Sequence[int]) -> None:
        if len(sequences) != len(labels):
            raise ValueError(f"{len(sequences)} sequences but {len(labels)} labels")
        self.sequences = sequences
        self.labels = labels

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.sequences[i], self.labels[i]

    def lengths(self) -> list[int]:
        return [len(s) for s in self.sequences]


def padded_length(longest: int, multiple: int = 1, cap: int | None = None) -> int:
    """``longest`` rounded up to a multiple of ``multiple``, but never above ``cap`` (the
    model's ``max_len``) unless ``longest`` itself is."""
    rounded = -(-max(1, longest) // multiple) * multiple
    return max(longest, min(rounded, cap)) if cap is not None else rounded


def pad_sequences(
    seqs: Sequence[np.ndarray | Sequence[int]],
    pad_id: int,
    *,
    multiple: int = 1,
    cap: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence, rounded up by ``padded_length``:
    ``(ids (B, L) long, mask (B, L) bool True = real)``."""
    longest = padded_length(max(len(s) for s in seqs), multiple, cap)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s)
        ids[i, :n] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[i, :n] = True
    return ids, mask


class PadCollate:
    """Collate ``(sequence, label)`` pairs into the single-sequence batch format, padded to
    a multiple of ``multiple`` tokens (at most ``cap``)."""

    def __init__(self, pad_id: int, multiple: int = 1, cap: int | None = None) -> None:
        self.pad_id, self.multiple, self.cap = pad_id, multiple, cap

    def __call__(self, items: Sequence[tuple[np.ndarray, int]]) -> dict[str, torch.Tensor]:
        ids, mask = pad_sequences(
            [s for s, _ in items], self.pad_id, multiple=self.multiple, cap=self.cap
        )
        labels = torch.tensor([int(y) for _, y in items], dtype=torch.long)
        return {"input_ids": ids, "padding_mask": mask, "labels": labels}


class BucketBatchSampler(BatchSampler):
    """Length-bucketed batches over the order of ``sampler``.

    Takes the sampler's order, sorts it by length within pools of ``pool_batches``
    batches, cuts the pools into batches and shuffles the batches (seeded by
    ``(seed, epoch)``). Being a ``BatchSampler`` over a sampler, Lightning can swap in a
    ``DistributedSampler`` under DDP: each rank then buckets its own shard. In training every
    rank gets the same number of batches because the distributed sampler pads its shards;
    in evaluation (``shuffle=False``) that padding is dropped, so that every example is
    scored exactly once (ranks may then differ by one batch).
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        *,
        lengths: Sequence[int],
        shuffle: bool = True,
        seed: int = 0,
        pool_batches: int = 50,
    ) -> None:
        super().__init__(sampler if shuffle else unrepeated(sampler), batch_size, drop_last)
        self.lengths = np.asarray(lengths)
        self.shuffle = shuffle
        self.seed = seed
        self.pool_batches = pool_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        # Lightning sets the epoch on the loader's batch sampler; pass it on to a
        # DistributedSampler inside so that its shuffling changes per epoch too.
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        pool = self.pool_batches * self.batch_size
        batches: list[list[int]] = []
        for start in range(0, len(order), pool):
            chunk = order[start : start + pool]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            for b in range(0, len(chunk), self.batch_size):
                batch = chunk[b : b + self.batch_size].tolist()
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            rng = np.random.default_rng((self.seed, self.epoch))
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return iter(batches)

    def __len__(self) -> int:
        n, pool = len(self.sampler), self.pool_batches * self.batch_size
        full, rest = divmod(n, pool)
        per_pool = pool // self.batch_size
        if self.drop_last:
            return full * per_pool + rest // self.batch_size
        return full * per_pool + math.ceil(rest / self.batch_size)


class EvenEvalBatchSampler(BatchSampler):
    """Evaluation batches of one rank's share, as many on every rank.

    Under DDP each rank scores its own share of a split, never repeating an example; the
    shares differ by at most one example, so with ``ceil(share / batch_size)`` batches a
    rank can run one batch more than the others. FSDP cannot allow that (every forward
    all-gathers across ranks): this sampler cuts every share into ``ceil(largest share /
    batch_size)`` batches of near-equal size (no batch above ``batch_size``), which the
    smaller shares can always fill when ``batch_size >= 2``. With ``lengths`` the share is
    sorted by length first (less padding). Like ``BucketBatchSampler``, it turns the
    padding ``DistributedSampler`` Lightning may put in its place into the unrepeated one.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        *,
        lengths: Sequence[int] | None = None,
    ) -> None:
        super().__init__(unrepeated(sampler), batch_size, drop_last=False)
        self.lengths = None if lengths is None else np.asarray(lengths)
        share = len(self.sampler)
        ranks = getattr(self.sampler, "num_replicas", 1)
        dataset = getattr(self.sampler, "dataset", None)
        total = len(dataset) if dataset is not None else share * ranks
        largest = math.ceil(total / ranks)
        # Fewer only if this share cannot fill them (batch_size 1): FSDP then says so.
        self.num_batches = min(math.ceil(largest / batch_size), share)

    def __iter__(self):
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        if self.num_batches == 0:  # an empty split
            return iter([])
        if self.lengths is not None:
            order = order[np.argsort(self.lengths[order], kind="stable")]
        return iter(b.tolist() for b in np.array_split(order, self.num_batches) if len(b))

    def __len__(self) -> int:
        return self.num_batches


def make_loader(
    ds: Dataset,
    *,
    batch_size: int,
    train: bool,
    collate_fn,
    num_workers: int,
    bucket_by_length: bool,
    seed: int,
) -> DataLoader:
    """Shuffled (train) or ordered (eval) loader, optionally length-bucketed; never drops
    the last batch, so the test set is evaluated in full. ``ds`` must have ``lengths()``
    when bucketing.

    Exact under DDP and on resume: the training order is a function of ``(seed, epoch)``
    (Lightning swaps in its ``DistributedSampler`` under DDP, also epoch-seeded); an
    evaluation loader built under DDP gives each rank a disjoint shard with no repeated
    examples, in as many batches on every rank (``EvenEvalBatchSampler``); the loader's
    position within an epoch is saved in checkpoints, and no loader draws from the global
    RNG (its own generator seeds the workers), so resuming does not shift dropout.
    """
    common = dict(
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    order = EpochRandomSampler(ds, seed=seed) if train else eval_sampler(ds)
    if not train and world()[0] > 1:
        lengths = ds.lengths() if bucket_by_length else None
        batches = EvenEvalBatchSampler(order, batch_size, lengths=lengths)
        return ResumableDataLoader(ds, batch_sampler=batches, **common)
    if bucket_by_length:
        batches = BucketBatchSampler(
            order, batch_size, lengths=ds.lengths(), shuffle=train, seed=seed
        )
        return ResumableDataLoader(ds, batch_sampler=batches, **common)
    return ResumableDataLoader(ds, batch_size=batch_size, sampler=order, drop_last=False, **common)


class SplitDataModule(L.LightningDataModule):
    """Base of every DataModule here: the loader settings, the splits each stage loads and
    the four dataloaders (``make_loader``).

    Subclasses implement ``make_dataset(split)`` (the split's dataset, refused when empty)
    and ``collate()``. Each parameter and its default is written once, in the class that
    uses it; a subclass declares only what it adds or what it defaults differently
    (``data_dir``, ``batch_size``) and hands the rest on with ``**kwargs`` to
    ``super().__init__``, which LightningCLI follows: ``--help`` and ``--print_config`` of
    the class named in a config list every parameter with the docstring that describes it.

    Args:
        data_dir: folder holding the task's files.
        batch_size: training batch size.
        eval_batch_size: validation/test batch size (default: batch_size).
        num_workers: DataLoader worker processes.
        train_size: use only the first N training examples.
        val_size: use only the first N validation examples.
        test_size: use only the first N test examples.
        bucket_by_length: batch sequences of similar length together.
        seed: seed of the length-bucketing sampler.
    """

    def __init__(
        self,
        *,
        data_dir: str,
        batch_size: int,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        train_size: int | None = None,
        val_size: int | None = None,
        test_size: int | None = None,
        bucket_by_length: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_loader_args(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            sizes=(train_size, val_size, test_size),
        )
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.bucket_by_length = bucket_by_length
        self.seed = seed
        self.datasets: dict[str, Dataset] = {}
        self.test_at_fit = False  # see splits_for

    def make_dataset(self, split: str) -> Dataset:
        raise NotImplementedError

    def collate(self):
        raise NotImplementedError

    def split_source(self, split: str) -> str:
        """Where ``split`` is read from, for messages (subclasses name the file)."""
        return f"{self.data_dir} ({split} split)"

    def setup(self, stage: str | None = None) -> None:
        for split in splits_for(stage, test_at_fit=self.test_at_fit):
            if split not in self.datasets:
                self.datasets[split] = self.make_dataset(split)

    def _loader(self, split: str, train: bool) -> DataLoader:
        return make_loader(
            self.datasets[split],
            batch_size=self.batch_size if train else self.eval_batch_size,
            train=train,
            collate_fn=self.collate(),
            num_workers=self.num_workers,
            bucket_by_length=self.bucket_by_length,
            seed=self.seed,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)


class SequenceDataModule(SplitDataModule):
    """Base for single-sequence classification tasks.

    Subclasses set ``vocab_size``, ``num_classes``, ``max_len`` and ``pad_id`` in
    ``__init__`` (the CLI links them into the model right after construction) and
    implement ``load_split(split) -> SequenceDataset`` for split in train / val / test.
    The other constructor arguments are SplitDataModule's.

    Args:
        pad_to_multiple_of: pad each batch to a multiple of this many tokens (at most
            ``max_len``): a bounded set of shapes keeps a long run's memory flat.
    """

    vocab_size: int
    num_classes: int
    max_len: int
    pad_id: int

    def __init__(self, *, pad_to_multiple_of: int = 64, **loader: Any) -> None:
        super().__init__(**loader)
        check_positive("pad_to_multiple_of", pad_to_multiple_of, allow_none=False)
        self.pad_to_multiple_of = pad_to_multiple_of

    def load_split(self, split: str) -> SequenceDataset:
        raise NotImplementedError

    def _subset(self, ds: SequenceDataset, split: str) -> SequenceDataset:
        n = self.sizes[split]
        if n is None or n >= len(ds):
            return ds
        return SequenceDataset(ds.sequences[:n], ds.labels[:n])

    def make_dataset(self, split: str) -> SequenceDataset:
        dataset = self.load_split(split)
        check_not_empty(len(dataset), split, self.split_source(split))
        return self._subset(dataset, split)

    def collate(self):
        return PadCollate(self.pad_id, self.pad_to_multiple_of, self.max_len)
