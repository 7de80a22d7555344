"""LRA Retrieval: do two ACL Anthology Network papers cite each other (Radev et al., 2013)?

Follows ``lra_benchmarks/matching/input_pipeline.py`` of
https://github.com/google-research/long-range-arena: tab-separated files without header
and with quoting off (``use_quote_delim=False``; here: lines split on ``\\n``, fields on
``\\t``, so a field may start with ``"``, exactly as ``csv.QUOTE_NONE``), fields
``label id1 id2 text1 text2``, labels written as floats (``1.0``) cast to int. Each text is
encoded as bytes, id = byte + 1, 0 = padding (vocabulary 257), cut to ``max_len`` = 4000
(LRA's ``char`` tokenizer). Splits: ``new_aan_pairs.train.tsv`` (147,086 pairs),
``.eval.tsv`` (18,090, used for validation), ``.test.tsv`` (17,437).

Sources, looked for under ``data_dir`` (``source="auto"`` takes the first found):

1. ``raw``: ``tsv_data/new_aan_pairs.{train,eval,test}.tsv`` from ``lra_release.gz``
   (also found under ``lra_release/`` or ``lra_release/lra_release/``: the archive
   unpacked as is).
2. ``skyformer``: ``lra_processed/lra-retrieval.{train,dev,test}.pickle`` (or directly in
   ``data_dir``) from Skyformer's ``create_retrieval.py``; their zero padding is removed.
   Pickles run code when loaded: they are read only from the ``data_dir`` you name.

Batch format::

    {"input_ids_0": (B, L0) long, "padding_mask_0": (B, L0) bool,
     "input_ids_1": (B, L1) long, "padding_mask_1": (B, L1) bool, "labels": (B,) long}

Each side is padded to its own longest document in the batch (L0 ≠ L1 in general);
masks are True at real tokens. Tokens are cached memory-mapped under
``data_dir/.cache/retrieval/`` (see :mod:`macformer_lit.data.lra_files`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from macformer_lit.data.common import (
    MissingDataError,
    SequenceDataset,
    pad_sequences,
)
from macformer_lit.data.lra_files import (
    LRA_URL,
    ByteDataModule,
    RaggedArray,
    RaggedDataset,
    find_skyformer,
    fingerprint,
    first_existing,
    lra_release_candidates,
    progress,
    read_skyformer,
    strip_padding,
)

log = logging.getLogger(__name__)

SKYFORMER_NAMES = ("lra-retrieval",)
TSV_NAMES = {"train": "train", "val": "eval", "test": "test"}


class PairDataset(RaggedDataset):
    """Document pairs: item ``i`` is ``((ids_0, ids_1), label)``."""

    def __init__(self, first: RaggedArray, second: RaggedArray, labels: Sequence[int]) -> None:
        super().__init__(first, labels)
        if len(second) != len(first):
            raise ValueError(f"{len(first)} first documents but {len(second)} second ones")
        self.second = second

    def __getitem__(self, i: int) -> tuple[tuple[np.ndarray, np.ndarray], int]:
        return (self.sequences[i], self.second[i]), self.labels[i]

    def lengths(self) -> list[int]:
        # Bucketing by the longer side bounds both paddings.
        return np.maximum(self.sequences.lengths(), self.second.lengths()).tolist()

    def head(self, n: int) -> PairDataset:
        return PairDataset(self.sequences[:n], self.second[:n], self.labels[:n])


class PairCollate:
    """Collate ``((ids_0, ids_1), label)`` items; each side padded to its own longest,
    rounded up to a multiple of ``multiple`` tokens (at most ``cap``)."""

    def __init__(self, pad_id: int, multiple: int = 1, cap: int | None = None) -> None:
        self.pad_id, self.multiple, self.cap = pad_id, multiple, cap

    def __call__(self, items) -> dict[str, torch.Tensor]:
        pad = dict(multiple=self.multiple, cap=self.cap)
        ids_0, mask_0 = pad_sequences([a for (a, _), _ in items], self.pad_id, **pad)
        ids_1, mask_1 = pad_sequences([b for (_, b), _ in items], self.pad_id, **pad)
        return {
            "input_ids_0": ids_0,
            "padding_mask_0": mask_0,
            "input_ids_1": ids_1,
            "padding_mask_1": mask_1,
            "labels": torch.tensor([int(y) for _, y in items], dtype=torch.long),
        }


class RetrievalDataModule(ByteDataModule):
    """AAN citation pairs as two byte sequences; see the module docstring for batches.

    The other constructor arguments are ByteDataModule's and its bases'.

    Args:
        data_dir: folder holding the LRA release's ``tsv_data/new_aan_pairs.*.tsv`` (or
            Skyformer's pickles).
        batch_size: training batch size.
    """

    def __init__(self, *, data_dir: str = "data/lra", batch_size: int = 16, **byte: Any) -> None:
        # max_len is per document: the model encodes each side separately.
        super().__init__(data_dir=data_dir, batch_size=batch_size, **byte)

    def collate(self):
        return PairCollate(self.pad_id, self.pad_to_multiple_of, self.max_len)

    def _tsv(self, split: str) -> Path | None:
        relative = f"tsv_data/new_aan_pairs.{TSV_NAMES[split]}.tsv"
        return first_existing(lra_release_candidates(self.data_dir, relative))

    def _resolve(self) -> str:
        found = self._found_source(all(self._tsv(s) for s in TSV_NAMES), SKYFORMER_NAMES)
        if found:
            return found
        if self.source == "skyformer":
            raise self._no_skyformer("LRA Retrieval (AAN)", SKYFORMER_NAMES)
        expected = [self.data_dir / f"tsv_data/new_aan_pairs.{n}.tsv" for n in TSV_NAMES.values()]
        how = (
            f"Download the LRA release ({LRA_URL}, 7.7 GB) and unpack it into {self.data_dir}:\n"
            f"  mkdir -p {self.data_dir} && "
            f"tar -xzf lra_release.gz -C {self.data_dir} --strip-components=1"
        )
        if self.source == "auto":
            how += "\n" + self._or_skyformer(SKYFORMER_NAMES)
        raise MissingDataError("LRA Retrieval (AAN)", expected, how)

    def prepare_data(self) -> None:
        # Rank 0 fills the cache once; the other ranks then only memory-map it.
        for split in ("train", "val", "test"):
            self.load_split(split)

    def load_split(self, split: str) -> SequenceDataset:
        source = self._resolve()
        path = (
            self._tsv(split)
            if source == "raw"
            else find_skyformer(self.data_dir, SKYFORMER_NAMES)[split]
        )
        settings = {
            "task": "retrieval",
            "split": split,
            "source": source,
            "max_len": self.max_len,
            "skip_malformed": self.skip_malformed,
        }
        key = fingerprint([path], settings)
        reader = self._read_tsv if source == "raw" else self._read_skyformer

        def build(stats: dict):
            stats.update(pairs=0, truncated=0, skipped=0, empty=0)
            for docs, label in progress(
                reader(path, stats), total=None, desc=f"tokenising AAN {split}"
            ):
                stats["pairs"] += 1
                yield docs, label

        (first, second), labels, stats, cached = self.token_cache("retrieval").load_or_build(
            split, key, build, fields=2
        )
        log.info(
            "AAN %s: %d pairs (%s%s); %d documents longer than max_len=%d were truncated",
            split,
            len(labels),
            path.name,
            ", from cache" if cached else "",
            stats["truncated"],
            self.max_len,
        )
        if stats.get("empty"):
            log.warning(
                "AAN %s: %d empty documents (their padding masks are all False)",
                split,
                stats["empty"],
            )
        if stats["skipped"]:
            log.warning(
                "AAN %s: skipped %d malformed rows of %s (skip_malformed=True)",
                split,
                stats["skipped"],
                path,
            )
        return PairDataset(first, second, labels)

    def _read_tsv(self, path: Path, stats: dict):
        # Bytes, not text: LRA encodes the file's raw bytes, whatever their encoding.
        with open(path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                line = raw.rstrip(b"\n").rstrip(b"\r")
                if not line.strip():
                    continue
                fields = line.split(b"\t")
                if len(fields) != 5:
                    self._bad(
                        path,
                        line_no,
                        f"expected 5 tab-separated fields, found {len(fields)}",
                        stats,
                    )
                    continue
                try:
                    label_f = float(fields[0])
                except ValueError:
                    self._bad(path, line_no, f"label {fields[0][:20]!r} is not a number", stats)
                    continue
                if label_f not in (0.0, 1.0):
                    self._bad(path, line_no, f"label {label_f} is not 0 or 1", stats)
                    continue
                docs = (self._encode(fields[3], stats), self._encode(fields[4], stats))
                stats["empty"] += sum(int(d.size == 0) for d in docs)
                yield docs, int(label_f)

    def _read_skyformer(self, path: Path, stats: dict):
        for i, ((a, b), label) in enumerate(read_skyformer(path, fields=2)):
            docs = [strip_padding(a), strip_padding(b)]
            if any(d.size and (d.min() < 1 or d.max() >= self.vocab_size) for d in docs):
                self._bad(path, None, f"item {i}: ids outside 1..{self.vocab_size - 1}", stats)
                continue
            if label not in (0, 1):
                self._bad(path, None, f"item {i}: label {label} not 0/1", stats)
                continue
            stats["truncated"] += sum(int(d.size > self.max_len) for d in docs)
            stats["empty"] += sum(int(d.size == 0) for d in docs)
            yield tuple(d[: self.max_len].astype(np.uint16) for d in docs), label
