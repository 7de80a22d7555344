import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from macformer_lit.data.common import (
    BucketBatchSampler,
    PadCollate,
    SequenceDataset,
    check_positive,
    make_loader,
)


def dataset(n=200, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 9, size=int(rng.integers(1, 100))) for _ in range(n)]
    return SequenceDataset(seqs, [0] * n)


def test_buckets_hold_similar_lengths_and_cover_everything():
    ds = dataset()
    torch.manual_seed(0)
    bs = BucketBatchSampler(RandomSampler(ds), 10, lengths=ds.lengths(), pool_batches=5)
    batches = list(bs)
    assert len(batches) == len(bs) == 20
    assert sorted(i for b in batches for i in b) == list(range(200))
    lengths = np.asarray(ds.lengths())
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    random_spread = np.mean([np.ptp(lengths[np.arange(i, i + 10)]) for i in range(0, 200, 10)])
    assert spread < random_spread / 3


def test_under_ddp_each_rank_buckets_its_own_shard_with_equal_batch_counts():
    ds = dataset(n=203)
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        bs = BucketBatchSampler(sampler, 8, lengths=ds.lengths())
        bs.set_epoch(3)
        assert sampler.epoch == 3
        batches = list(bs)
        assert len(batches) == len(bs)
        shards.append([i for b in batches for i in b])
    assert len(shards[0]) == len(shards[1]) == 102
    # The distributed sampler pads 203 to 204 with one repeated index; the rest is disjoint.
    assert len(set(shards[0]) | set(shards[1])) == 203


def test_eval_loader_keeps_order_within_pools_and_last_batch():
    ds = dataset(n=25)
    loader = make_loader(
        ds,
        batch_size=4,
        train=False,
        collate_fn=PadCollate(0),
        num_workers=0,
        bucket_by_length=True,
        seed=0,
    )
    assert isinstance(loader.batch_sampler.sampler, SequentialSampler)
    assert sum(b["labels"].numel() for b in loader) == 25


def test_pad_collate_pads_to_longest_in_batch():
    batch = PadCollate(0)([(np.array([3, 4]), 1), (np.array([5, 6, 7, 8]), 0)])
    assert batch["input_ids"].tolist() == [[3, 4, 0, 0], [5, 6, 7, 8]]
    assert batch["padding_mask"].tolist() == [[True, True, False, False], [True] * 4]
    assert batch["labels"].tolist() == [1, 0]


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_check_positive_rejects(value):
    with pytest.raises(ValueError, match="train_size must be a positive integer"):
        check_positive("train_size", value)


@pytest.mark.parametrize("n", [9, 13, 25, 101, 200])
@pytest.mark.parametrize("batch_size", [2, 3, 4, 8])
@pytest.mark.parametrize("world", [2, 3])
def test_even_eval_batches_equal_counts_and_every_example_once(n, batch_size, world):
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    from macformer_lit.data.common import EvenEvalBatchSampler

    ds = dataset(n=n)
    counts, seen = [], []
    for rank in range(world):
        # What Lightning injects into an evaluation batch sampler under DDP: padding.
        padding = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        bs = EvenEvalBatchSampler(padding, batch_size, lengths=ds.lengths())
        assert isinstance(bs.sampler, UnrepeatedDistributedSampler)
        batches = list(bs)
        assert len(batches) == len(bs) and all(0 < len(b) <= batch_size for b in batches)
        lengths = [ds.lengths()[i] for b in batches for i in b]
        assert lengths == sorted(lengths)  # sorted by length: least padding
        counts.append(len(batches))
        seen += [i for b in batches for i in b]
    assert len(set(counts)) == 1
    assert sorted(seen) == list(range(n))


def test_even_eval_batches_cannot_even_out_batches_of_one():
    from macformer_lit.data.common import EvenEvalBatchSampler

    ds = dataset(n=9)
    counts = [
        len(EvenEvalBatchSampler(DistributedSampler(ds, 2, rank, shuffle=False), 1))
        for rank in (0, 1)
    ]
    # Shares of 5 and 4 examples: as many batches of one as examples (FSDP refuses this).
    assert counts == [5, 4]
    # An empty split: no batch, no error.
    empty = dataset(n=0)
    assert list(EvenEvalBatchSampler(DistributedSampler(empty, 2, 0, shuffle=False), 4)) == []


def test_padded_length_rounds_up_and_stops_at_the_cap():
    from macformer_lit.data.common import pad_sequences, padded_length

    assert [padded_length(n, 64) for n in (1, 63, 64, 65, 128)] == [64, 64, 64, 128, 128]
    assert [padded_length(n, 64, cap=100) for n in (1, 65, 99, 100)] == [64, 100, 100, 100]
    assert padded_length(7, 1) == 7
    ids, mask = pad_sequences([[3, 4, 5], [6]], 0, multiple=4)
    assert ids.tolist() == [[3, 4, 5, 0], [6, 0, 0, 0]]
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False]]
