import csv
import json
import random

import lightning as L
import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from macformer_lit import cli
from macformer_lit.data.synthetic_translation import SyntheticTranslationDataModule
from macformer_lit.loggers import AutoWandbLogger, RunCSVLogger
from macformer_lit.tasks.translator import (
    CorpusBLEU,
    LitTranslator,
    TokenPerplexity,
    label_smoothed_nll,
)

SMALL_MODEL = dict(
    d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, ffn_dim=64, dropout=0.0
)
TINY_DATA = dict(
    train_size=256, val_size=16, test_size=16, tokenizer_vocab_size=300, batch_size=32, max_len=96
)


WORDS = "the a dog cat runs sleeps in house , . Mann Hund schläft".split()


def sentences(rng, n):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


@pytest.mark.parametrize("kwargs", [{}, {"lowercase": True, "tokenize": "intl"}])
def test_bleu_equals_sacrebleu_corpus_bleu(kwargs):
    rng = random.Random(0)
    refs = sentences(rng, 60)
    hyps = [r if rng.random() < 0.3 else s for r, s in zip(refs, sentences(rng, 60))]
    hyps[3] = hyps[3].upper()
    metric = CorpusBLEU(**kwargs)
    for lo in range(0, 60, 25):
        metric.update(hyps[lo : lo + 25], refs[lo : lo + 25])
    scorer = sacrebleu.BLEU(**kwargs)
    expected = scorer.corpus_score(hyps, [refs])
    assert 0 < expected.score < 100
    assert float(metric.compute()) == pytest.approx(expected.score, abs=1e-4)
    assert float(metric.compute()) == sacrebleu.corpus_bleu(hyps, [refs], **kwargs).score
    assert metric.signature() == str(scorer.get_signature())
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        metric.update(["a", "b"], ["a"])


def test_loss_and_perplexity_match_torch():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(1, 11, (3, 5))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    for eps in (0.0, 0.1):
        loss, nll_sum, n = label_smoothed_nll(logits, labels, pad_id=0, epsilon=eps)
        expected = F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=0, label_smoothing=eps
        )
        torch.testing.assert_close(loss, expected)
    ppl = TokenPerplexity()
    ppl.update(nll_sum, n)
    _, nll_more, n_more = label_smoothed_nll(logits[:1], labels[:1], pad_id=0, epsilon=0.1)
    ppl.update(nll_more, n_more)
    both = torch.cat([labels, labels[:1]])
    ce = F.cross_entropy(torch.cat([logits, logits[:1]]).transpose(1, 2), both, ignore_index=0)
    torch.testing.assert_close(ppl.compute(), ce.exp())


def test_bad_arguments():
    args = dict(vocab_size=20, max_len=16, pad_id=0, bos_id=1, eos_id=2)
    for bad, match in (
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"beam_size": 0}, "beam_size"),
        ({"lr": 0.0}, "lr must be positive"),
        ({"max_len_a": -1.0}, "max_len_a"),
    ):
        with pytest.raises(ValueError, match=match):
            LitTranslator(**args, **bad)


def _assert_bleu_of(result, hyps, refs) -> float:
    """The logged test/bleu and test/bleu_tok are sacreBLEU's corpus scores of these strings."""
    bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
    bleu_tok = sacrebleu.BLEU(lowercase=True, tokenize="intl").corpus_score(hyps, [refs]).score
    assert result["test/bleu"] == pytest.approx(bleu, rel=1e-6)
    assert result["test/bleu_tok"] == pytest.approx(bleu_tok, rel=1e-6)
    return bleu


def test_fit_logs_ppl_bleu_signatures_and_a_wandb_table(tmp_path):
    L.seed_everything(0)
    dm = SyntheticTranslationDataModule(data_dir=str(tmp_path / "data"), **TINY_DATA)
    model = LitTranslator(
        vocab_size=dm.vocab_size,
        max_len=dm.max_len,
        pad_id=dm.pad_id,
        bos_id=dm.bos_id,
        eos_id=dm.eos_id,
        lr=3e-3,
        warmup_steps=4,
        num_samples=3,
        beam_size=2,
        **SMALL_MODEL,
    )
    wandb_logger = AutoWandbLogger(save_dir=str(tmp_path / "run"), mode="offline")
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=2,
        logger=[RunCSVLogger(str(tmp_path / "run")), wandb_logger],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    (result,) = trainer.test(model, datamodule=dm, verbose=False)
    translations = trainer.predict(model, datamodule=dm)
    assert len(translations[0]["translations"]) == len(translations[0]["sources"])
    assert set(result) >= {"test/loss", "test/ppl", "test/bleu", "test/bleu_tok"}
    # The logged scores are those of the strings the model decodes, over the whole test set.
    model.eval()
    hyps, refs = [], []
    for batch in dm.test_dataloader():
        hyps += model.translate(batch)
        refs += list(batch["tgt_text"])
    assert len(refs) == TINY_DATA["test_size"]
    _assert_bleu_of(result, hyps, refs)
    # Two epochs leave that BLEU at 0, which a lost batch would not move. Score known strings
    # instead (each reference with every sixth word dropped, BLEU 62) in batches of 5, so the
    # logged value is a corpus BLEU summed over four batches, the last one short.
    known = {}

    def clipped(batch):
        out = [
            " ".join(w for i, w in enumerate(r.split()) if i % 6 != 5) for r in batch["tgt_text"]
        ]
        known.update(zip(batch["tgt_text"], out))
        return out

    model.translate, dm.eval_batch_size = clipped, 5
    (again,) = trainer.test(model, datamodule=dm, verbose=False)
    del model.translate
    dm.eval_batch_size = TINY_DATA["batch_size"]
    assert list(known) == refs  # the same test set, in the same order
    assert 30 < _assert_bleu_of(again, list(known.values()), refs) < 90
    wandb_logger.experiment.finish()
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    val = [(float(r["val/loss"]), float(r["val/ppl"])) for r in rows if r.get("val/loss")]
    assert len(val) == 2 and val[1][0] < val[0][0]
    assert all(r.get("val/bleu") for r in rows if r.get("val/loss"))
    hparams = (tmp_path / "run" / "hparams.yaml").read_text()
    assert "tok:13a" in hparams and "tok:intl" in hparams and "case:lc" in hparams
    tables = list(
        (tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/*/samples_*.table.json")
    )
    assert {p.parent.name for p in tables} == {"val", "test"}
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["source", "reference", "translation"] and len(table["data"]) == 3


def cli_args(tmp_path, *extra):
    return [
        "--config",
        "translation_synthetic.yaml",
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.train_size",
        "64",
        "--data.val_size",
        "8",
        "--data.test_size",
        "8",
        "--data.tokenizer_vocab_size",
        "300",
        "--data.max_len",
        "96",
        "--model.d_model",
        "32",
        "--model.num_heads",
        "2",
        "--model.ffn_dim",
        "64",
        "--runs_dir",
        str(tmp_path / "runs"),
        "--wandb_mode",
        "disabled",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        *extra,
    ]


def test_cli_links_data_into_the_model_and_sets_attention_per_role(tmp_path):
    override = tmp_path / "roles.yaml"
    override.write_text(
        "model:\n  attention: {name: softmax, dropout: 0.2}\n"
        "  cross_attention: {name: softmax, dropout: 0.3}\n"
    )
    made = cli.MacformerCLI(cli_args(tmp_path, "--config", str(override)), run=False)
    dm, task = made.datamodule, made.model
    for key in ("vocab_size", "max_len", "pad_id", "bos_id", "eos_id"):
        assert task.hparams[key] == getattr(dm, key)
    block = task.model.blocks[0]
    assert task.model.encoder.blocks[0].attn.backend.dropout == 0.2
    assert block.self_attn.backend.dropout == 0.2 and block.cross_attn.backend.dropout == 0.3


def test_cli_fast_dev_run_on_the_synthetic_task(tmp_path, capsys):
    cli.main(
        [
            "fit",
            *cli_args(
                tmp_path, "--trainer.fast_dev_run", "true", "--trainer.enable_progress_bar", "false"
            ),
        ]
    )
    out = capsys.readouterr().out
    assert "test/bleu = " in out and "test/ppl = " in out and "test/bleu_tok = " in out
