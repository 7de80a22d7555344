"""LRA Text: IMDb sentiment at the byte level (Tay et al., 2021; Maas et al., 2011).

Follows ``lra_benchmarks/text_classification/input_pipeline.py`` of
https://github.com/google-research/long-range-arena (``get_imdb_dataset`` with the
``char`` tokenizer): the review's UTF-8 bytes (tfds strips surrounding whitespace), id =
byte + 1, 0 = padding (vocabulary 257), cut to ``max_len`` = 4000; labels neg = 0, pos = 1.
IMDb has no validation split and LRA validates on the **test** split: so does this
module (``val`` is the ``test`` set, logged at setup).

Sources, looked for under ``data_dir`` (``source="auto"`` takes the first found):

1. ``raw``: ``aclImdb/{train,test}/{pos,neg}/*.txt``, the unpacked ``aclImdb_v1.tar.gz``.
   An exported copy is read too when ``aclImdb/`` is absent: ``imdb/{train,test}.jsonl``
   (one ``{"text": ..., "label": 0|1}`` per line), ``imdb/{train,test}.csv`` (header with
   ``text`` and ``label``) or ``imdb/{train,test}*.parquet`` (the Hugging Face
   ``stanfordnlp/imdb`` files; read with pyarrow, which ``datasets`` installs). Labels may
   also be ``"neg"``/``"pos"``.
2. ``skyformer``: ``lra_processed/lra-text.{train,test}.pickle`` (or directly in
   ``data_dir``), from Skyformer's ``create_text.py``; their zero padding is removed.
   Pickles run code when loaded: they are read only from the ``data_dir`` you name.

Documents are tokenised once into a memory-mapped cache under ``data_dir/.cache/text/``
(see :mod:`macformer_lit.data.lra_files`). The fixed shuffle of the aclImdb files (which
are listed neg-then-pos) makes ``train_size``/``val_size`` subsets class-balanced.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from macformer_lit.data.common import (
    DataFormatError,
    MissingDataError,
    SequenceDataset,
)
from macformer_lit.data.lra_files import (
    IMDB_URL,
    SKYFORMER_URL,
    ByteDataModule,
    RaggedDataset,
    find_skyformer,
    fingerprint,
    progress,
    read_skyformer,
    skyformer_expected,
    strip_padding,
)

log = logging.getLogger(__name__)

SKYFORMER_NAMES = ("lra-text",)
# Fixed, so the cached order (and so every subset) is the same on every machine.
_ORDER_SEED = 0
_LABELS = {"0": 0, "1": 1, "neg": 0, "pos": 1}


class TextDataModule(ByteDataModule):
    """IMDb reviews as byte sequences; batches ``{"input_ids", "padding_mask", "labels"}``.

    The other constructor arguments are ByteDataModule's and its bases'.

    Args:
        data_dir: folder holding ``aclImdb/`` (or ``imdb/`` exports, or Skyformer's pickles).
        batch_size: training batch size.
    """

    def __init__(self, *, data_dir: str = "data/lra", batch_size: int = 32, **byte: Any) -> None:
        super().__init__(data_dir=data_dir, batch_size=batch_size, **byte)
        self._loaded: dict[str, SequenceDataset] = {}

    def _raw_files(self, split: str) -> tuple[str, list[Path]] | None:
        acl = self.data_dir / "aclImdb" / split
        if (acl / "pos").is_dir() and (acl / "neg").is_dir():
            return "aclimdb", [acl / "neg", acl / "pos"]
        folder = self.data_dir / "imdb"
        for name in (f"{split}.jsonl", f"{split}.csv"):
            if (folder / name).is_file():
                return "export", [folder / name]
        parquet = sorted(folder.glob(f"{split}*.parquet")) + sorted(
            folder.glob(f"*/{split}-*.parquet")
        )
        if parquet:
            return "export", parquet
        return None

    def _resolve(self) -> str:
        raw = all(self._raw_files(s) for s in ("train", "test"))
        found = self._found_source(raw, SKYFORMER_NAMES)
        if found:
            return found
        if self.source == "skyformer":
            raise MissingDataError(
                "LRA Text (IMDb)",
                skyformer_expected(self.data_dir, SKYFORMER_NAMES),
                f"Skyformer's pre-processed pickles: see {SKYFORMER_URL}",
            )
        expected = [
            self.data_dir / "aclImdb" / s / c for s in ("train", "test") for c in ("pos", "neg")
        ]
        how = (
            f"Download the IMDb reviews ({IMDB_URL}) and unpack them into {self.data_dir}:\n"
            f"  mkdir -p {self.data_dir} && tar -xzf aclImdb_v1.tar.gz -C {self.data_dir}\n"
            f"or export them to {self.data_dir / 'imdb'}/{{train,test}}.jsonl "
            "(fields text, label)"
        )
        if self.source == "auto":
            how += ", " + self._or_skyformer(SKYFORMER_NAMES)
        raise MissingDataError("LRA Text (IMDb)", expected, how)

    def prepare_data(self) -> None:
        # Rank 0 fills the cache once; the other ranks then only memory-map it.
        for split in ("train", "test"):
            self._load(split)

    def load_split(self, split: str) -> SequenceDataset:
        if split == "val":
            log.info("IMDb has no validation split: validating on the test split, as LRA does")
            split = "test"
        return self._load(split)

    def _load(self, split: str) -> SequenceDataset:
        if split in self._loaded:
            return self._loaded[split]
        source = self._resolve()
        if source == "skyformer":
            paths = [find_skyformer(self.data_dir, SKYFORMER_NAMES)[split]]
            kind = "skyformer"
        else:
            kind, paths = self._raw_files(split)
        files = self._list_files(kind, paths)
        if not files:
            raise DataFormatError(paths[0].parent, None, f"no reviews (*.txt) for {split}")
        settings = {
            "task": "text",
            "split": split,
            "kind": kind,
            "max_len": self.max_len,
            "skip_malformed": self.skip_malformed,
        }
        key = fingerprint(files, settings)
        desc = f"tokenising IMDb {split}"

        def build(stats: dict):
            stats.update(documents=0, truncated=0, skipped=0)
            if kind == "aclimdb":
                items = self._read_aclimdb(files, stats)
            elif kind == "export":
                items = self._read_export(files, stats)
            else:
                items = self._read_skyformer(files[0], stats)
            for tokens, label in progress(
                items, total=len(files) if kind == "aclimdb" else None, desc=desc
            ):
                stats["documents"] += 1
                yield (tokens,), label

        (tokens,), labels, stats, cached = self.token_cache("text").load_or_build(
            split, key, build, fields=1
        )
        log.info(
            "IMDb %s: %d reviews (%s%s); %d longer than max_len=%d were truncated",
            split,
            len(labels),
            kind,
            ", from cache" if cached else "",
            stats["truncated"],
            self.max_len,
        )
        if stats["skipped"]:
            log.warning(
                "IMDb %s: skipped %d malformed rows (skip_malformed=True)", split, stats["skipped"]
            )
        self._loaded[split] = RaggedDataset(tokens, labels)
        return self._loaded[split]

    @staticmethod
    def _list_files(kind: str, paths: list[Path]) -> list[Path]:
        if kind != "aclimdb":
            return paths
        files = []
        for folder in paths:
            with os.scandir(folder) as it:
                files += sorted(Path(e.path) for e in it if e.name.endswith(".txt"))
        order = np.random.default_rng(_ORDER_SEED).permutation(len(files))
        return [files[i] for i in order]

    def _read_aclimdb(self, files: list[Path], stats: dict):
        for path in files:
            # tfds' imdb builder: label from the folder, text = file bytes, stripped.
            text = path.read_bytes().strip()
            if not text:
                self._bad(path, None, "empty review", stats)
                continue
            yield self._encode(text, stats), int(path.parent.name == "pos")

    def _read_export(self, files: list[Path], stats: dict):
        for path in files:
            if path.suffix == ".parquet":
                rows = self._parquet_rows(path)
            elif path.suffix == ".csv":
                rows = self._csv_rows(path)
            else:
                rows = self._jsonl_rows(path)
            for line, row in rows:
                if row is None:
                    self._bad(path, line, "not valid JSON", stats)
                    continue
                text, label = row.get("text"), _LABELS.get(str(row.get("label")).strip().lower())
                if not isinstance(text, str) or label is None:
                    self._bad(
                        path, line, f"need a text string and a label 0/1; got {row!r:.80}", stats
                    )
                    continue
                data = text.strip().encode("utf-8")
                if not data:
                    self._bad(path, line, "empty review", stats)
                    continue
                yield self._encode(data, stats), label

    @staticmethod
    def _jsonl_rows(path: Path):
        with open(path, encoding="utf-8") as fh:
            for line, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except json.JSONDecodeError:
                    row = None
                yield line, row if row is None or isinstance(row, dict) else {"row": row}

    @staticmethod
    def _csv_rows(path: Path):
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not {"text", "label"} <= set(reader.fieldnames):
                raise DataFormatError(
                    path, 1, f"header must name text and label; got {reader.fieldnames}"
                )
            start = 2
            for row in reader:
                yield start, row
                start = reader.line_num + 1

    @staticmethod
    def _parquet_rows(path: Path):
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["text", "label"])
        for i, row in enumerate(table.to_pylist()):
            # Parquet has rows, not lines: report the 1-based row number.
            yield i + 1, row

    def _read_skyformer(self, path: Path, stats: dict):
        for i, ((ids,), label) in enumerate(read_skyformer(path, fields=1)):
            ids = strip_padding(ids)
            if ids.size and (ids.min() < 1 or ids.max() >= self.vocab_size):
                self._bad(path, None, f"item {i}: ids outside 1..{self.vocab_size - 1}", stats)
                continue
            if label not in (0, 1):
                self._bad(path, None, f"item {i}: label {label} not 0/1", stats)
                continue
            stats["truncated"] += int(ids.size > self.max_len)
            yield ids[: self.max_len].astype(np.uint16), label
