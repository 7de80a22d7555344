"""DDP through the real CLI (2 gloo processes on CPU): fit + test for ListOps and the
synthetic translation task, exactly one W&B run, and test metrics over the whole test set
exactly once: the same numbers as one process on the same checkpoint.

The test sets hold 13 examples with batches of 4: 13 does not divide by 2 x 4, so a
padding DistributedSampler would score one example twice, and the ranks see 7 and 6
examples (Lightning's ``sync_dist`` mean then divides by a truncated example count).
"""

from __future__ import annotations

import math

import pytest
import torch
from ddp_probe import fit_on_two_then_test_on_one, metric, read_rows, stage_metrics

LISTOPS = [
    "--config",
    "lra_listops.yaml",
    "--data.train_size",
    "32",
    "--data.val_size",
    "13",
    "--data.test_size",
    "13",
    "--data.batch_size",
    "4",
    "--model.init_args.d_model",
    "16",
    "--model.init_args.num_layers",
    "1",
    "--model.init_args.ffn_dim",
    "32",
    # A model that has moved away from the uniform prediction, so accuracy is not 0 or 1.
    "--model.init_args.lr",
    "3e-3",
    "--model.init_args.warmup_steps",
    "1",
    "--trainer.max_steps",
    "6",
    "--trainer.val_check_interval",
    "3",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]

TRANSLATION = [
    "--config",
    "translation_synthetic.yaml",
    "--data.train_size",
    "32",
    "--data.val_size",
    "13",
    "--data.test_size",
    "13",
    "--data.batch_size",
    "4",
    "--data.tokenizer_vocab_size",
    "300",
    "--model.init_args.d_model",
    "16",
    "--model.init_args.num_heads",
    "2",
    "--model.init_args.num_encoder_layers",
    "1",
    "--model.init_args.num_decoder_layers",
    "1",
    "--model.init_args.ffn_dim",
    "32",
    "--model.init_args.max_len_b",
    "4",
    "--model.init_args.lr",
    "3e-3",
    "--model.init_args.warmup_steps",
    "1",
    "--trainer.max_steps",
    "6",
    "--trainer.max_epochs",
    "-1",
    "--trainer.val_check_interval",
    "3",
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(scope="module")
def listops_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_listops")
    probe = tmp / "callbacks.yaml"
    probe.write_text(
        "trainer:\n  callbacks:\n    - class_path: ddp_probe.LocalLoss\n"
        f"      init_args:\n        out: {tmp / 'probe'}\n"
    )
    extra = ("--config", str(probe))
    return tmp, *fit_on_two_then_test_on_one(tmp, LISTOPS, tmp / "data", "offline", extra)


def test_ddp_listops_fit_logs_one_wandb_run_and_trains(listops_runs):
    tmp, fit_dir, _ = listops_runs
    assert len(list(tmp.glob("runs/**/offline-run-*"))) == 1
    assert len(list(fit_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    rows = read_rows(fit_dir / "metrics.csv")
    assert [s for s, _ in metric(rows, "train/loss_step")] == list(range(6))
    assert len(metric(rows, "val/acc")) == 2
    assert (fit_dir / "checkpoints/last.ckpt").is_file()


def test_ddp_train_loss_is_the_mean_over_both_ranks(listops_runs):
    tmp, fit_dir, _ = listops_runs
    ranks = [torch.load(tmp / f"probe/loss_rank{r}.pt") for r in (0, 1)]
    logged = dict(metric(read_rows(fit_dir / "metrics.csv"), "train/loss_step"))
    assert [s for s, _, _ in ranks[0]] == [s for s, _, _ in ranks[1]] == sorted(logged)
    differ = 0
    for (step, loss0, n0), (_, loss1, n1) in zip(*ranks):
        differ += not math.isclose(loss0, loss1, rel_tol=1e-3)
        expected = (loss0 * n0 + loss1 * n1) / (n0 + n1)
        assert math.isclose(logged[step], expected, rel_tol=1e-6), (step, logged[step], expected)
    # The ranks saw different examples, so rank 0's own loss would not pass the check.
    assert differ >= 3


def test_ddp_logs_peak_memory_per_rank_and_their_max(listops_runs):
    _, fit_dir, _ = listops_runs
    rows = [r for r in read_rows(fit_dir / "metrics.csv") if r.get("train/peak_rss_mb")]
    assert rows, "no epoch ended"
    for row in rows:
        per_rank = [float(row[f"train/peak_rss_mb_rank{r}"]) for r in (0, 1)]
        assert all(v > 10 for v in per_rank)  # a Python process with torch: tens of MB at least
        assert float(row["train/peak_rss_mb"]) == max(per_rank)
    assert "train/peak_rss_mb_rank2" not in rows[0]


def test_ddp_fit_leaves_a_single_run_folder(listops_runs):
    tmp, _, _ = listops_runs
    assert [p.name for p in (tmp / "runs/ddp").iterdir()] == ["version_0"]


def test_ddp_listops_test_metrics_equal_one_process(listops_runs):
    _, fit_dir, one_dir = listops_runs
    two, one = stage_metrics(fit_dir), stage_metrics(one_dir)
    assert set(one) == {"test/acc", "test/loss"} == set(two)
    # Not a degenerate accuracy, so that a duplicated or dropped example would show.
    assert 0.0 < float(one["test/acc"]) < 1.0
    # Accuracy is a ratio of counts: exactly equal.
    assert float(two["test/acc"]) == float(one["test/acc"])
    assert math.isclose(float(two["test/loss"]), float(one["test/loss"]), rel_tol=1e-6)


def test_ddp_translation_test_metrics_equal_one_process(tmp_path):
    fit_dir, one_dir = fit_on_two_then_test_on_one(
        tmp_path, TRANSLATION, tmp_path / "data", "disabled"
    )
    two, one = stage_metrics(fit_dir), stage_metrics(one_dir)
    assert {"test/loss", "test/ppl", "test/bleu", "test/bleu_tok"} <= set(one)
    assert set(two) == set(one)
    # Six steps leave BLEU at 0 (too short to learn the grammar within this file's time
    # budget): BLEU is compared, loss and perplexity carry the check.
    assert 1.0 < float(one["test/ppl"]) < 1e4
    for key in one:
        # BLEU from summed n-gram counts: equal unless a decoded sentence changed.
        assert math.isclose(float(two[key]), float(one[key]), rel_tol=1e-5), key
