"""LitTranslator: sequence-to-sequence translation with loss, perplexity and BLEU per stage.

Training minimises label-smoothed cross-entropy (Szegedy et al. 2016, as in fairseq's
``label_smoothed_cross_entropy``). Every stage logs ``stage/loss`` (that objective,
token-weighted) and ``stage/ppl``, the exponential of the plain token-level cross-entropy
over real (non-padding) target tokens. Validation and test also decode (greedy, or beam
search with ``beam_size > 1``) and score the detokenised output against the raw
references:

- ``stage/bleu``: sacreBLEU with its defaults (13a tokenisation, case-sensitive), the
  number to compare across papers; its signature is logged as a hyper-parameter;
- ``stage/bleu_tok``: BLEU on lower-cased text split at every punctuation mark
  (sacreBLEU's ``intl`` tokeniser, close to the Moses-tokenised, lower-cased BLEU that
  bentrevett's tutorials and most Multi30K papers quote); signature logged too.

BLEU is corpus-level: sacreBLEU's sufficient statistics are summed over batches (and over
ranks under DDP) before the score is computed, so it equals ``sacrebleu.corpus_bleu`` on
the same strings. Loss and perplexity are likewise sums over ranks (token-weighted), so
every validation and test value is exact under DDP; the training loss is the
token-weighted mean over all ranks' batches (``reduce.global_mean``).
A table of sample translations goes to W&B.

The DataModule turns ids into text through its ``detokenize(ids) -> str``; without a
DataModule, set ``LitTranslator.detokenizer`` yourself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from sacrebleu.metrics import BLEU
from torchmetrics import Metric

from macformer_lit.models.seq2seq import Seq2SeqTransformer

from .base import STAGES, LitTask
from .optim import check_optim_args
from .reduce import eval_mean_losses, log_stage_loss


class CorpusBLEU(Metric):
    """sacreBLEU corpus BLEU (0-100) accumulated over batches through its statistics."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, *, lowercase: bool = False, tokenize: str = "13a") -> None:
        super().__init__()
        self.scorer = BLEU(lowercase=lowercase, tokenize=tokenize)
        # One reference per sentence; sacreBLEU only learns this when it first scores.
        self.scorer.num_refs = 1
        n = self.scorer.max_ngram_order
        # hyp length, ref length, matches per order, totals per order (sacreBLEU's layout)
        self.add_state(
            "stats", default=torch.zeros(2 + 2 * n, dtype=torch.long), dist_reduce_fx="sum"
        )

    def update(self, hypotheses: Sequence[str], references: Sequence[str]) -> None:
        if len(hypotheses) != len(references):
            raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
        if not hypotheses:
            return
        rows = self.scorer._extract_corpus_statistics(list(hypotheses), [list(references)])
        self.stats += torch.tensor(rows, dtype=torch.long, device=self.stats.device).sum(0)

    def compute(self) -> torch.Tensor:
        score = self.scorer._compute_score_from_stats(self.stats.tolist()).score
        return torch.tensor(score, dtype=torch.float64)

    def signature(self) -> str:
        return str(self.scorer.get_signature())


class TokenPerplexity(Metric):
    """exp(mean negative log-likelihood per real target token), summed in float64."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nll", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nll_sum: torch.Tensor, tokens: torch.Tensor | int) -> None:
        self.nll += nll_sum.detach().double()
        self.tokens += torch.as_tensor(tokens, dtype=torch.long, device=self.tokens.device)

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll / self.tokens.clamp_min(1)).float()


def label_smoothed_nll(
    logits: torch.Tensor, labels: torch.Tensor, *, pad_id: int, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean label-smoothed cross-entropy over non-padding labels (as torch's
    ``cross_entropy(label_smoothing=epsilon, ignore_index=pad_id)``), the summed plain
    negative log-likelihood, and the number of real tokens. ``logits`` (B, T, V)."""
    logp = logits.float().log_softmax(-1)
    real = labels != pad_id
    n_tokens = real.sum()
    nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)[real]  # (n_tokens,)
    per_token = nll
    if epsilon > 0:
        # (1 - eps) * nll + eps * cross-entropy against the uniform distribution.
        per_token = (1.0 - epsilon) * nll - epsilon * logp[real].mean(-1)
    return per_token.sum() / n_tokens.clamp_min(1), nll.sum(), n_tokens


class LitTranslator(LitTask):
    model_classes = (Seq2SeqTransformer,)

    checkpoint_monitor = ("val/loss", "min")

    # The task's own options; the model's are Seq2SeqTransformer's (LitTask).
    def __init__(
        self,
        *,
        label_smoothing: float = 0.1,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        max_len_a: float = 1.5,
        max_len_b: int = 10,
        bleu_on_val: bool = True,
        num_samples: int = 10,
        lr: float = 5e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-9,
        warmup_steps: int = 500,
        **model: Any,
    ) -> None:
        """
        Args:
            **model: the translation model's options (``models.Seq2SeqTransformer``: sizes,
                ``attention`` and its per-role overrides, embeddings), passed to it as
                they are.
            label_smoothing: epsilon of the training loss (0 = plain cross-entropy).
            beam_size: 1 decodes greedily; more uses beam search (val and test).
            max_len_a, max_len_b: decode at most ``a * source length + b`` tokens
                (fairseq's ``--max-len-a/b``), and never more than ``max_len``.
            bleu_on_val: decode the validation set every validation for ``val/bleu``.
            num_samples: sample translations per validation/test sent to W&B.
        """
        super().__init__()
        check_optim_args(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
        if beam_size <= 0:
            raise ValueError(f"beam_size must be positive; got {beam_size}")
        if max_len_a < 0 or max_len_b < 0 or max_len_a == max_len_b == 0:
            raise ValueError(
                f"max_len_a, max_len_b must be >= 0, not both 0; got {max_len_a}, {max_len_b}"
            )
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0; got {num_samples}")
        specs = self.parse_specs(model)
        self.save_hyperparameters()
        self.record_model_defaults()
        model.update(specs)  # the model builds from the parsed values
        self.model = Seq2SeqTransformer(**model)
        # nn.Module reserves the key "train", hence the suffixes.
        self.ppl = torch.nn.ModuleDict({f"{s}_ppl": TokenPerplexity() for s in STAGES})
        # Not Lightning's sync_dist mean: it truncates an all-reduced integer weight.
        self.mean_loss = eval_mean_losses()
        self.bleu = torch.nn.ModuleDict({f"{s}_bleu": CorpusBLEU() for s in ("val", "test")})
        self.bleu_tok = torch.nn.ModuleDict(
            {f"{s}_bleu_tok": CorpusBLEU(lowercase=True, tokenize="intl") for s in ("val", "test")}
        )
        self.detokenizer: Callable[[Sequence[int]], str] | None = None
        self._samples: list[list[str]] = []
        self._signatures_logged = False

    # ---- steps --------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        """Teacher-forced next-token logits (B, T-1, V) for ``batch["tgt_ids"][:, 1:]``."""
        tgt_mask = batch.get("tgt_padding_mask")
        return self.model(
            batch["src_ids"],
            batch.get("src_padding_mask"),
            batch["tgt_ids"][:, :-1],
            None if tgt_mask is None else tgt_mask[:, :-1],
        )

    def _shared_step(self, batch: dict[str, Any], stage: str) -> torch.Tensor:
        labels = batch["tgt_ids"][:, 1:]
        loss, nll_sum, n_tokens = label_smoothed_nll(
            self(batch), labels, pad_id=self.hparams.pad_id, epsilon=self.hparams.label_smoothing
        )
        ppl = self.ppl[f"{stage}_ppl"]
        ppl.update(nll_sum, n_tokens)
        # Token-weighted epoch means, like the perplexity.
        weight = max(int(n_tokens), 1)
        log_stage_loss(self, stage, loss, weight)
        self.log_stage_metric(stage, "ppl", ppl, weight)
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        if self.hparams.bleu_on_val:
            self._score(batch, "val")

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self._score(batch, "test")

    def predict_step(self, batch, batch_idx):
        return {"translations": self.translate(batch), "sources": batch.get("src_text")}

    # ---- decoding and BLEU --------------------------------------------------------------
    def _detokenize(self, ids: Sequence[int]) -> str:
        fn = self.detokenizer
        if fn is None:
            datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
            fn = getattr(datamodule, "detokenize", None)
        if fn is None:
            raise RuntimeError(
                "LitTranslator needs a detokenizer for BLEU: use a translation DataModule "
                "(it has detokenize(ids)) or set model.detokenizer = fn"
            )
        return fn(ids)

    @torch.no_grad()
    def translate(self, batch: dict[str, Any]) -> list[str]:
        """Decode the batch's sources into detokenised strings.

        Each sentence gets its own budget, ``max_len_a * its source length + max_len_b``
        tokens, so a translation does not depend on which sentences share its batch (under
        DDP the batches differ from one process's). Greedy rows are independent: one call
        with the largest budget, each row cut to its own. Beam search ranks finished and
        unfinished hypotheses by length, so it runs once per distinct budget.
        """
        hp = self.hparams
        src_ids, src_mask = batch["src_ids"], batch.get("src_padding_mask")
        if src_mask is not None:
            lengths = src_mask.sum(1).tolist()
        else:
            lengths = [src_ids.shape[1]] * src_ids.shape[0]
        budgets = [min(max(1, int(hp.max_len_a * n + hp.max_len_b)), hp.max_len) for n in lengths]
        groups = {max(budgets): list(range(len(budgets)))} if hp.beam_size == 1 else {}
        if hp.beam_size != 1:
            for i, budget in enumerate(budgets):
                groups.setdefault(budget, []).append(i)
        out: list[list[int]] = [[] for _ in budgets]
        for budget, rows in groups.items():
            index = torch.tensor(rows, device=src_ids.device)
            ids = self.model.generate(
                src_ids[index],
                None if src_mask is None else src_mask[index],
                beam_size=hp.beam_size,
                max_new_tokens=budget,
                length_penalty=hp.length_penalty,
            )
            for i, row in zip(rows, ids):
                out[i] = list(row)[: budgets[i]]
        return [self._detokenize(row) for row in out]

    def _score(self, batch: dict[str, Any], stage: str) -> None:
        hyps = self.translate(batch)
        refs = list(batch["tgt_text"])
        bleu, bleu_tok = self.bleu[f"{stage}_bleu"], self.bleu_tok[f"{stage}_bleu_tok"]
        bleu.update(hyps, refs)
        bleu_tok.update(hyps, refs)
        self.log(f"{stage}/bleu", bleu, on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}/bleu_tok", bleu_tok, on_step=False, on_epoch=True)
        room = self.hparams.num_samples - len(self._samples)
        if room > 0:
            srcs = batch.get("src_text") or [""] * len(hyps)
            self._samples += [list(t) for t in zip(srcs, refs, hyps)][:room]

    def on_validation_epoch_start(self) -> None:
        self._samples = []

    def on_test_epoch_start(self) -> None:
        self._samples = []

    def on_validation_epoch_end(self) -> None:
        self._publish("val")

    def on_test_epoch_end(self) -> None:
        self._publish("test")

    def _publish(self, stage: str) -> None:
        """Log the BLEU signatures once and the sample table of this epoch."""
        scored = stage == "test" or self.hparams.bleu_on_val
        if self.trainer.sanity_checking or not scored:
            return
        if not self._signatures_logged:
            signatures = {
                "bleu_signature": self.bleu[f"{stage}_bleu"].signature(),
                "bleu_tok_signature": self.bleu_tok[f"{stage}_bleu_tok"].signature(),
            }
            rank_zero_info(
                f"{stage}/bleu: sacreBLEU {signatures['bleu_signature']}; "
                f"{stage}/bleu_tok: {signatures['bleu_tok_signature']}"
            )
            for logger in self.loggers:
                logger.log_hyperparams(signatures)
            self._signatures_logged = True
        for logger in self.loggers if self._samples else []:
            if isinstance(logger, WandbLogger):
                try:
                    logger.log_table(
                        key=f"{stage}/samples",
                        columns=["source", "reference", "translation"],
                        data=self._samples,
                        step=self.global_step,
                    )
                except Exception as err:  # noqa: BLE001 - a table must never stop training
                    rank_zero_warn(f"could not log the sample table to W&B: {err}")
