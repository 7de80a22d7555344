"""Multi30K (Elliott et al. 2016), task 1: image-caption translation, docs/data.md §9.

Reads, in this order of preference:

1. ``hf_dataset`` when given: a hub id (``bentrevett/multi30k``, rows ``{"en": …, "de": …}``
   in ``train``/``validation``/``test``), loaded with Hugging Face ``datasets`` (needs the
   network or the datasets cache), or a local ``.jsonl`` file/folder of the same rows.
   WMT-style rows ``{"translation": {"en": …, "de": …}}`` are read too.
2. The raw files of github.com/multi30k/dataset (``data/task1/raw``) in ``data_dir``:
   ``train.{lang}``, ``val.{lang}`` and ``test_2016_flickr.{lang}`` (29,000 / 1,014 / 1,000
   lines), each plain or gzipped (``.gz``), one sentence a line.
3. ``train.jsonl``, ``val.jsonl`` (or ``validation.jsonl``) and ``test.jsonl`` in
   ``data_dir``, through ``datasets``' json loader.

Sentences are kept as released (true case, untokenised; ``lowercase=True`` follows the
bentrevett tutorials, which lower-case everything) and split into subwords by a tokenizer
trained on the training split and cached in ``<data_dir>/tokenizers`` (``translation.py``).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

from macformer_lit.data.common import DataFormatError, MissingDataError
from macformer_lit.data.translation import TranslationDataModule

LANGUAGES = ("en", "de", "fr", "cs")
HUB_SPLITS = {"train": ("train",), "val": ("validation", "val", "valid"), "test": ("test",)}
HOW_TO_GET = (
    "Get the public copy from https://github.com/multi30k/dataset (folder data/task1/raw), "
    "for example:\n"
    "  mkdir -p {dir} && for f in train val test_2016_flickr; do for l in {src} {tgt}; do\n"
    "    wget -P {dir} https://github.com/multi30k/dataset/raw/master/data/task1/raw/$f.$l.gz\n"
    "  done; done\n"
    "or, on a machine that is online, read the hub copy with "
    "--data.init_args.hf_dataset bentrevett/multi30k (en/de only)."
)


def read_lines(path: Path) -> list[str]:
    """One sentence a line, plain or gzipped, UTF-8, surrounding whitespace removed."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [line.strip() for line in f.read().splitlines()]
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as err:
        raise DataFormatError(
            path, None, f"not a UTF-8 text file (plain or gzipped): {err}"
        ) from err


class Multi30kDataModule(TranslationDataModule):
    def __init__(
        self,
        *,
        data_dir: str = "data/multi30k",
        src_lang: str = "en",
        tgt_lang: str = "de",
        hf_dataset: str | None = None,
        test_split: str = "test_2016_flickr",
        tokenizer_vocab_size: int = 8000,
        max_len: int = 128,
        batch_size: int = 128,
        bucket_by_length: bool = True,
        **translation: Any,
    ) -> None:
        """
        Args:
            data_dir: folder of the raw files (or jsonl splits); tokenizers are cached here.
            src_lang: one of ``en``, ``de``, ``fr``, ``cs`` (En→De by default).
            tgt_lang: another of them.
            hf_dataset: hub id or local jsonl file/folder, read with ``datasets``.
            test_split: raw-file stem of the test set (``test_2016_flickr``,
                ``test_2017_flickr``, ``test_2017_mscoco``, ``test_2018_flickr``).
            tokenizer_vocab_size: subword vocabulary size.
            max_len: longest sequence in tokens (with <s>/</s>); longer ones are truncated.
            batch_size: training batch size.
            bucket_by_length: batch sentences of similar length together.

        The other arguments are TranslationDataModule's and its base's.
        """
        if src_lang not in LANGUAGES or tgt_lang not in LANGUAGES or src_lang == tgt_lang:
            raise ValueError(
                f"unknown language pair {src_lang}→{tgt_lang}; Multi30K task 1 has "
                f"{', '.join(LANGUAGES)} (two different ones)"
            )
        super().__init__(
            data_dir=data_dir,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            tokenizer_vocab_size=tokenizer_vocab_size,
            max_len=max_len,
            batch_size=batch_size,
            bucket_by_length=bucket_by_length,
            **translation,
        )
        self.hf_dataset = hf_dataset
        self.test_split = test_split
        self._hub = None
        self.build_vocabulary()

    # ---- sources ------------------------------------------------------------------------
    def raw_stem(self, split: str) -> str:
        return {"train": "train", "val": "val", "test": self.test_split}[split]

    def _raw_file(self, split: str, lang: str) -> Path | None:
        stem = self.data_dir / f"{self.raw_stem(split)}.{lang}"
        for path in (stem, stem.with_name(stem.name + ".gz")):
            if path.is_file():
                return path
        return None

    @staticmethod
    def _jsonl_files(folder: Path) -> dict[str, Path] | None:
        """``{split: file}`` when ``folder`` holds a json(l) file for every split."""
        found = {}
        for split, names in HUB_SPLITS.items():
            for name in names:
                for suffix in (".jsonl", ".json", ".jsonl.gz"):
                    if (folder / f"{name}{suffix}").is_file():
                        found.setdefault(split, folder / f"{name}{suffix}")
        return found if len(found) == len(HUB_SPLITS) else None

    def read_split(self, split: str) -> tuple[list[str], list[str]]:
        if self.hf_dataset is not None:
            return self._read_hub(split)
        paths = [self._raw_file(split, lang) for lang in (self.src_lang, self.tgt_lang)]
        if all(p is not None for p in paths):
            return self._read_raw(split, paths[0], paths[1])
        if self._jsonl_files(self.data_dir) is not None:
            return self._read_hub(split)
        # Name every raw file a run needs, not just the first one that is missing.
        missing = [
            f"{self.data_dir / f'{self.raw_stem(s)}.{lang}'}[.gz]"
            for s in ("train", "val", "test")
            for lang in (self.src_lang, self.tgt_lang)
            if self._raw_file(s, lang) is None
        ]
        raise MissingDataError(
            f"Multi30K {self.src_lang}→{self.tgt_lang}",
            missing,
            HOW_TO_GET.format(dir=self.data_dir, src=self.src_lang, tgt=self.tgt_lang),
        )

    def _read_raw(self, split: str, src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
        src, tgt = read_lines(src_path), read_lines(tgt_path)
        if len(src) != len(tgt):
            raise DataFormatError(
                tgt_path, None, f"{len(tgt)} lines, but {src_path} has {len(src)}: not parallel"
            )
        return src, tgt

    def _load_hub(self):
        if self._hub is not None:
            return self._hub
        import datasets

        spec = self.hf_dataset
        local = Path(spec).expanduser() if spec is not None else self.data_dir
        try:
            if spec is None or local.exists():
                if local.is_dir():
                    files = self._jsonl_files(local)
                    if files is None:
                        raise MissingDataError(
                            f"Multi30K jsonl splits in {local}",
                            [local / f"{n[0]}.jsonl" for n in HUB_SPLITS.values()],
                            "Each line is one JSON object with a field per language.",
                        )
                    data_files = {split: str(p) for split, p in files.items()}
                else:
                    data_files = {"train": str(local)}
                # Arrow copies of local files go beside the data, not into ~/.cache.
                self._hub = datasets.load_dataset(
                    "json", data_files=data_files, cache_dir=str(self.data_dir / "hf_cache")
                )
            else:
                self._hub = datasets.load_dataset(spec)
        except MissingDataError:
            raise
        except Exception as err:  # noqa: BLE001 - datasets raises many types for "not there"
            raise MissingDataError(
                f"Multi30K from {spec!r} through Hugging Face datasets ({type(err).__name__}: "
                f"{err})",
                [spec],
                "A hub id needs the network or a filled datasets cache (HF_DATASETS_OFFLINE=1 "
                "only reads the cache). Otherwise use the raw files in --data.init_args."
                "data_dir. "
                + HOW_TO_GET.format(dir=self.data_dir, src=self.src_lang, tgt=self.tgt_lang),
            ) from err
        return self._hub

    def _read_hub(self, split: str) -> tuple[list[str], list[str]]:
        hub = self._load_hub()
        name = next((n for n in HUB_SPLITS[split] if n in hub), None)
        if name is None:
            raise DataFormatError(
                self.hf_dataset or self.data_dir,
                None,
                f"no {split} split (looked for {', '.join(HUB_SPLITS[split])}; "
                f"found {', '.join(hub)})",
            )
        rows = hub[name]
        columns = rows.column_names
        if "translation" in columns and self.src_lang not in columns:
            pairs = rows["translation"]
            rows = {lang: [p.get(lang) for p in pairs] for lang in (self.src_lang, self.tgt_lang)}
        else:
            rows = {
                lang: rows[lang] if lang in columns else None
                for lang in (self.src_lang, self.tgt_lang)
            }
        for lang, values in rows.items():
            if values is None or any(v is None for v in values):
                raise DataFormatError(
                    self.hf_dataset or self.data_dir,
                    None,
                    f"split {name!r} has no {lang!r} text for every row (columns: "
                    f"{', '.join(columns)})",
                )
        return (
            [s.strip() for s in rows[self.src_lang]],
            [t.strip() for t in rows[self.tgt_lang]],
        )
