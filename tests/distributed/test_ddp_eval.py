"""DDP through the real CLI (2 gloo processes on CPU): fit + test for ListOps and the
synthetic translation task, exactly one W&B run, and test metrics over the whole test set
exactly once: the same numbers as one process on the same checkpoint.

The test sets hold 13 examples with batches of 4: 13 does not divide by 2 x 4, so a
padding DistributedSampler would score one example twice, and the ranks see 7 and 6
examples (Lightning's ``sync_dist`` mean then divides by a truncated example count).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import sacrebleu
import torch
from ddp_probe import fit_on_two_then_test_on_one, metric, read_rows, stage_metrics
from sacrebleu.metrics import BLEU

from macformer_lit.tasks.translator import LitTranslator

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
    assert set(one) == {"test/acc", "test/loss", "test/majority_acc"} == set(two)
    # The majority class's share is a ratio of label counts summed over ranks: equal too.
    assert float(two["test/majority_acc"]) == float(one["test/majority_acc"])
    # Not a degenerate accuracy, so that a duplicated or dropped example would show.
    assert 0.0 < float(one["test/acc"]) < 1.0
    # Accuracy is a ratio of counts: exactly equal.
    assert float(two["test/acc"]) == float(one["test/acc"])
    assert math.isclose(float(two["test/loss"]), float(one["test/loss"]), rel_tol=1e-6)


class ClippedTranslator(LitTranslator):
    """Importable by the CLI subprocesses (this folder is on their PYTHONPATH). Its
    "translation" of a test sentence is the reference with every sixth word dropped, so
    test BLEU is far from 0 and known in closed form, whichever rank decodes the sentence;
    the (reference, hypothesis) pairs each rank scored are saved to
    ``$EVAL_PROBE_DIR/world<w>_rank<r>.pt``. Loss and perplexity still come from the model."""

    def _score(self, batch, stage):
        if stage != "test":
            return super()._score(batch, stage)
        pairs = [(ref, clip(ref)) for ref in batch["tgt_text"]]
        self._pairs = getattr(self, "_pairs", []) + pairs
        self.translate = lambda batch: [hyp for _, hyp in pairs]  # for this batch only
        try:
            super()._score(batch, stage)
        finally:
            del self.translate

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        out = Path(os.environ["EVAL_PROBE_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        name = f"world{self.trainer.world_size}_rank{self.trainer.global_rank}.pt"
        torch.save(getattr(self, "_pairs", []), out / name)


def clip(sentence: str) -> str:
    return " ".join(w for i, w in enumerate(sentence.split()) if i % 6 != 5)


@pytest.mark.slow
def test_ddp_translation_test_metrics_equal_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("EVAL_PROBE_DIR", str(tmp_path / "probe"))
    base = [*TRANSLATION, "--model.class_path", "test_ddp_eval.ClippedTranslator"]
    fit_dir, one_dir = fit_on_two_then_test_on_one(tmp_path, base, tmp_path / "data", "disabled")
    two, one = stage_metrics(fit_dir), stage_metrics(one_dir)
    assert {"test/loss", "test/ppl", "test/bleu", "test/bleu_tok"} <= set(one)
    assert set(two) == set(one)
    assert 1.0 < float(one["test/ppl"]) < 1e4
    # The ranks scored disjoint halves that together are the one process's test set, once.
    ranks = [torch.load(tmp_path / f"probe/world2_rank{r}.pt") for r in (0, 1)]
    single = torch.load(tmp_path / "probe/world1_rank0.pt")
    assert len(single) == 13 and all(ranks)
    assert sorted(ranks[0] + ranks[1]) == sorted(single)
    refs, hyps = [r for r, _ in single], [h for _, h in single]
    expected = {
        "test/bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "test/bleu_tok": BLEU(lowercase=True, tokenize="intl").corpus_score(hyps, [refs]).score,
    }
    # Far from 0 and from 100 (62.4), so that a rank's n-gram counts missing from the sum, or
    # counted twice, would move it.
    assert 30 < expected["test/bleu"] < 90
    for key, value in expected.items():
        assert math.isclose(float(one[key]), value, rel_tol=1e-5), (key, one[key], value)
        assert math.isclose(float(two[key]), value, rel_tol=1e-5), (key, two[key], value)
    assert math.isclose(float(two["test/loss"]), float(one["test/loss"]), rel_tol=1e-5)
    assert math.isclose(float(two["test/ppl"]), float(one["test/ppl"]), rel_tol=1e-5)
