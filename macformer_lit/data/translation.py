"""Shared pieces of the translation DataModules: subword tokenizers, the batch, the base class.

Tokenizers are trained on the training split with Hugging Face ``tokenizers`` and cached as
JSON beside the data (``<data_dir>/tokenizers/``), keyed by a fingerprint of the settings
and of the training text, so a changed corpus never reuses a stale vocabulary:

- ``bpe``: byte-level BPE (GPT-2 / RoBERTa pre-tokenisation). Every string is encodable,
  there is no unknown token, and decoding restores the text exactly.
- ``unigram``: the unigram language model of SentencePiece (Kudo 2018) with NFKC
  normalisation and SentencePiece's ``▁`` word boundaries; characters unseen in training
  become ``<unk>`` and are dropped on decoding.

Either one tokenizer shared by both languages (``shared_vocab=True``, the fairseq
``--joined-dictionary`` setup, needed to share encoder and decoder embeddings) or one per
side. The special tokens have the same ids on both sides: ``<pad>`` 0, ``<s>`` 1 (bos),
``</s>`` 2 (eos), ``<unk>`` 3. With two tokenizers ``vocab_size`` is the larger of the two,
so one embedding size fits both sides.

Batch format (``TranslationCollate``), padded to the longest sequence of the batch:

    {"src_ids": (B, S) long,  source tokens then </s>
     "src_padding_mask": (B, S) bool, True = real token,
     "tgt_ids": (B, T) long,  <s> target tokens </s>  (decoder input = [:, :-1], labels = [:, 1:])
     "tgt_padding_mask": (B, T) bool,
     "src_text": list[str], "tgt_text": list[str]}  the untokenised sentences (BLEU references)

Mask names end in ``_mask`` so that ``ThroughputMemoryMonitor`` counts real tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch.utils.data import Dataset

from macformer_lit.data.common import (
    SplitDataModule,
    check_not_empty,
    check_positive,
    pad_sequences,
    remove_stale_temporaries,
    staging_path,
)

log = logging.getLogger(__name__)

TokenizerKind = Literal["bpe", "unigram"]
TOKENIZER_KINDS = ("bpe", "unigram")
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Bumped whenever the tokenizer recipe changes, so that old cache files are not reused.
RECIPE_VERSION = 1
# Byte-level BPE starts from the 256 byte symbols plus the special tokens.
MIN_BPE_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(texts: Sequence[str], *, kind: TokenizerKind, vocab_size: int):
    """Train a ``tokenizers.Tokenizer`` on ``texts``; specials get ids 0-3 (see module doc)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "bpe":
        if vocab_size < MIN_BPE_VOCAB:
            raise ValueError(
                f"byte-level BPE needs tokenizer_vocab_size >= {MIN_BPE_VOCAB} (256 bytes + "
                f"{len(SPECIAL_TOKENS)} special tokens); got {vocab_size}"
            )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            unk_token=UNK,
            show_progress=False,
        )
    else:
        raise ValueError(f"unknown tokenizer {kind!r}; valid: {', '.join(TOKENIZER_KINDS)}")
    tok.train_from_iterator(texts, trainer=trainer)
    for expected, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != expected:
            raise RuntimeError(
                f"special token {name} got id {tok.token_to_id(name)}, not {expected}"
            )
    return tok


def fingerprint(texts: Sequence[str], *parts: object) -> str:
    h = hashlib.sha1(repr((RECIPE_VERSION, *parts)).encode())
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:12]


def cached_tokenizer(
    texts: Sequence[str], *, kind: TokenizerKind, vocab_size: int, cache_dir: Path, label: str
):
    """Load ``<cache_dir>/<label>-<kind><V>-<fingerprint>.json`` or train and save it."""
    from tokenizers import Tokenizer

    path = cache_dir / f"{label}-{kind}{vocab_size}-{fingerprint(texts, kind, vocab_size)}.json"
    if path.is_file():
        log.info("Loading tokenizer %s", path)
        return Tokenizer.from_file(str(path)), path
    tok = train_tokenizer(texts, kind=kind, vocab_size=vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write then rename: concurrent DDP ranks never read a half-written file.
    remove_stale_temporaries(cache_dir)  # a writer killed outright left them
    tmp = staging_path(path)
    try:
        tok.save(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("Trained tokenizer %s (%d tokens)", path, tok.get_vocab_size())
    return tok, path


class TranslationDataset(Dataset):
    """Token id arrays of both sides with their source sentences."""

    def __init__(
        self,
        src: Sequence[np.ndarray],
        tgt: Sequence[np.ndarray],
        src_text: Sequence[str],
        tgt_text: Sequence[str],
    ) -> None:
        if not len(src) == len(tgt) == len(src_text) == len(tgt_text):
            raise ValueError("source and target sides have different numbers of sentences")
        self.src, self.tgt = src, tgt
        self.src_text, self.tgt_text = src_text, tgt_text

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, str, str]:
        return self.src[i], self.tgt[i], self.src_text[i], self.tgt_text[i]

    def lengths(self) -> list[int]:
        return [len(s) + len(t) for s, t in zip(self.src, self.tgt)]


class TranslationCollate:
    """Collate ``(src, tgt, src_text, tgt_text)`` items into the batch format above."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items) -> dict:
        src_ids, src_mask = pad_sequences([it[0] for it in items], self.pad_id)
        tgt_ids, tgt_mask = pad_sequences([it[1] for it in items], self.pad_id)
        return {
            "src_ids": src_ids,
            "src_padding_mask": src_mask,
            "tgt_ids": tgt_ids,
            "tgt_padding_mask": tgt_mask,
            "src_text": [it[2] for it in items],
            "tgt_text": [it[3] for it in items],
        }


class TranslationDataModule(SplitDataModule):
    """Base for sentence-pair tasks. Subclasses implement ``read_split(split)`` returning
    ``(source sentences, target sentences)`` and call ``build_vocabulary()`` at the end of
    their ``__init__``: ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id`` and ``max_len``
    then exist before the CLI links them into the model. The other constructor arguments
    are SplitDataModule's.

    Args:
        src_lang: source language.
        tgt_lang: target language.
        tokenizer: the subword model, ``bpe`` or ``unigram`` (trained on the training
            split and cached under ``<data_dir>/tokenizers``).
        tokenizer_vocab_size: subword vocabulary size.
        shared_vocab: one vocabulary for source and target.
        lowercase: lower-case every sentence before tokenising.
        max_len: longest sequence in tokens (with <s>/</s>); longer ones are truncated.
    """

    pad_id = SPECIAL_TOKENS.index(PAD)
    bos_id = SPECIAL_TOKENS.index(BOS)
    eos_id = SPECIAL_TOKENS.index(EOS)
    unk_id = SPECIAL_TOKENS.index(UNK)
    vocab_size: int

    def __init__(
        self,
        *,
        src_lang: str,
        tgt_lang: str,
        tokenizer_vocab_size: int,
        max_len: int,
        tokenizer: TokenizerKind = "bpe",
        shared_vocab: bool = True,
        lowercase: bool = False,
        **loader: Any,
    ) -> None:
        check_positive("tokenizer_vocab_size", tokenizer_vocab_size)
        check_positive("max_len", max_len)
        super().__init__(**loader)
        if max_len < 3:
            raise ValueError(f"max_len must leave room for <s>, a token and </s>; got {max_len}")
        if tokenizer not in TOKENIZER_KINDS:
            raise ValueError(
                f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZER_KINDS)}"
            )
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.tokenizer_kind = tokenizer
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.shared_vocab = shared_vocab
        self.lowercase = lowercase
        self.max_len = max_len
        self.texts: dict[str, tuple[list[str], list[str]]] = {}

    # ---- what subclasses provide --------------------------------------------------------
    def read_split(self, split: str) -> tuple[list[str], list[str]]:
        raise NotImplementedError

    @property
    def tokenizer_dir(self) -> Path:
        return self.data_dir / "tokenizers"

    # ---- text and vocabulary ------------------------------------------------------------
    def split_texts(self, split: str) -> tuple[list[str], list[str]]:
        """The (possibly lower-cased, subsetted) sentence pairs of ``split``, read once."""
        if split not in self.texts:
            src, tgt = self.read_split(split)
            if len(src) != len(tgt):
                raise ValueError(
                    f"{split}: {len(src)} {self.src_lang} sentences but {len(tgt)} "
                    f"{self.tgt_lang} sentences"
                )
            n = self.sizes[split]
            src, tgt = list(src[:n]), list(tgt[:n])
            if self.lowercase:
                src, tgt = [s.lower() for s in src], [t.lower() for t in tgt]
            self.texts[split] = (src, tgt)
        return self.texts[split]

    def build_vocabulary(self) -> None:
        src, tgt = self.split_texts("train")
        kind, size = self.tokenizer_kind, self.tokenizer_vocab_size
        if self.shared_vocab:
            # Interleaved, so that the fingerprint depends on the pairing, not just the sets.
            texts = [s for pair in zip(src, tgt) for s in pair]
            label = f"shared-{self.src_lang}-{self.tgt_lang}"
            tok, path = cached_tokenizer(
                texts, kind=kind, vocab_size=size, cache_dir=self.tokenizer_dir, label=label
            )
            self.src_tokenizer = self.tgt_tokenizer = tok
            self.tokenizer_files = [path]
        else:
            self.src_tokenizer, src_path = cached_tokenizer(
                src, kind=kind, vocab_size=size, cache_dir=self.tokenizer_dir, label=self.src_lang
            )
            self.tgt_tokenizer, tgt_path = cached_tokenizer(
                tgt, kind=kind, vocab_size=size, cache_dir=self.tokenizer_dir, label=self.tgt_lang
            )
            self.tokenizer_files = [src_path, tgt_path]
        self.src_vocab_size = self.src_tokenizer.get_vocab_size()
        self.tgt_vocab_size = self.tgt_tokenizer.get_vocab_size()
        self.vocab_size = max(self.src_vocab_size, self.tgt_vocab_size)

    def encode_source(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Source sentences → id arrays ending in ``</s>``, at most ``max_len`` long."""
        out = []
        for enc in self.src_tokenizer.encode_batch(list(texts)):
            ids = enc.ids[: self.max_len - 1] + [self.eos_id]
            out.append(np.asarray(ids, dtype=np.int64))
        return out

    def encode_target(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Target sentences → ``<s> ids </s>``, at most ``max_len`` long."""
        out = []
        for enc in self.tgt_tokenizer.encode_batch(list(texts)):
            ids = [self.bos_id] + enc.ids[: self.max_len - 2] + [self.eos_id]
            out.append(np.asarray(ids, dtype=np.int64))
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        """Target ids → text; stops at ``</s>``, drops special and out-of-vocabulary ids."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        ids = [i for i in ids if len(SPECIAL_TOKENS) <= i < self.tgt_vocab_size]
        return self.tgt_tokenizer.decode(ids, skip_special_tokens=True).strip()

    # ---- what SplitDataModule builds the loaders from -----------------------------------
    def make_dataset(self, split: str) -> TranslationDataset:
        src, tgt = self.split_texts(split)
        check_not_empty(len(src), split, self.split_source(split))
        src_ids, tgt_ids = self.encode_source(src), self.encode_target(tgt)
        cut = sum(len(ids) == self.max_len for ids in src_ids + tgt_ids)
        if cut:
            log.warning("%s: %d sequence(s) cut to max_len=%d tokens", split, cut, self.max_len)
        return TranslationDataset(src_ids, tgt_ids, src, tgt)

    def collate(self) -> TranslationCollate:
        return TranslationCollate(self.pad_id)
