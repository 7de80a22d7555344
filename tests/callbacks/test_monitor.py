import torch

from macformer_lit.callbacks.monitor import ThroughputMemoryMonitor, count_tokens


def test_count_tokens_uses_padding_masks():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    batch = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "padding_mask": mask,
        "labels": torch.zeros(2),
    }
    assert count_tokens(batch) == (2, 3)
    two_docs = {
        "input_ids_0": torch.zeros(2, 3),
        "padding_mask_0": mask,
        "input_ids_1": torch.zeros(2, 4),
        "padding_mask_1": torch.ones(2, 4, dtype=torch.bool),
        "labels": torch.zeros(2),
    }
    assert count_tokens(two_docs) == (2, 3 + 8)
    # No mask: every id counts.
    assert count_tokens({"input_ids": torch.zeros(2, 5)}) == (2, 10)


def test_total_time_survives_a_checkpoint():
    cb = ThroughputMemoryMonitor()
    cb.total_time = 12.5
    restored = ThroughputMemoryMonitor()
    restored.load_state_dict(cb.state_dict())
    assert restored.total_time == 12.5


def test_a_checkpoint_inside_an_epoch_counts_its_steps_so_far():
    """Stopped midway through an epoch, the run's training time must not lose the steps
    it ran in that epoch: the resumed process adds only its own; at the epoch's end the
    epoch is in total_time already and is not counted twice."""
    cb = ThroughputMemoryMonitor()
    cb.total_time, cb._epoch_time = 10.0, 2.5  # 2.5 s of steps into the next epoch
    restored = ThroughputMemoryMonitor()
    restored.load_state_dict(cb.state_dict())
    assert restored.total_time == 12.5
    cb.total_time, cb._epoch_counted = 12.5, True  # the epoch's end added it
    assert cb.state_dict()["total_time"] == 12.5
