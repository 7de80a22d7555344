"""Shared helpers and base classes of the LRA DataModules: where the downloads live, byte
tokenisation, a memory-mapped token cache, and Skyformer's pre-processed pickles.

Byte tokenisation follows LRA's ``tfds.deprecated.text.ByteTextEncoder`` as used by
``lra_benchmarks/{text_classification,matching}/input_pipeline.py``: the UTF-8 bytes of
a document, id = byte + 1 (0 is padding), cut to ``max_len``.

Cache layout (one entry per split and source state), under ``<cache_dir>/<task>/``::

    <split>-<key>.json           metadata, written last: the entry is complete iff it exists
    <split>-<key>.tok<f>.bin     token ids of field f (uint16 for bytes, uint8 for pixels),
                                 all documents back to back; read with numpy.memmap
    <split>-<key>.idx.npy        (fields, n + 1) int64 offsets into each .bin
    <split>-<key>.labels.npy     (n,) int64

``key`` hashes the format version, the task's settings (``max_len`` …) and the path, size
and modification time of every source file, so editing, adding or removing a source file
or changing ``max_len`` selects a new entry; older entries of the same split are deleted
once the new one is written. Entries are written under temporary names and renamed, so
concurrent writers (DDP ranks) cannot leave a half-written entry behind.

Skyformer pickles (https://github.com/pkuzengqi/Skyformer, ``src/preprocess/create_*.py``)
are lists of dicts ``{"input_ids_0": int array, ["input_ids_1": int array,] "label": int}``
written by ``pickle``; Skyformer padded byte documents with zeros to 4096, which
:func:`strip_padding` removes again (0 is never a real byte id). Unpickling runs arbitrary
code from the file: these readers only open files under the ``data_dir`` the user names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from macformer_lit.data.common import (
    DataFormatError,
    MissingDataError,
    SequenceDataModule,
    SequenceDataset,
    remove_stale_temporaries,
)

log = logging.getLogger(__name__)

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
LRA_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
SKYFORMER_URL = "https://github.com/pkuzengqi/Skyformer#data-preparation"

CACHE_VERSION = 1
SPLITS = ("train", "val", "test")
# Skyformer names the validation split "dev".
SKYFORMER_SPLIT = {"train": "train", "val": "dev", "test": "test"}


def lra_release_candidates(data_dir: Path, relative: str) -> list[Path]:
    """Where a file of the LRA release may be: ``data_dir/relative`` (the archive unpacked
    with its top folder stripped), else under ``lra_release/`` once or twice (unpacked as
    is; Skyformer's scripts expect the doubled folder)."""
    nested = data_dir / "lra_release"
    return [data_dir / relative, nested / relative, nested / "lra_release" / relative]


def first_existing(candidates: Iterable[Path]) -> Path | None:
    for path in candidates:
        if path.exists():
            return path
    return None


def encode_bytes(data: bytes, max_len: int) -> tuple[np.ndarray, bool]:
    """UTF-8 bytes → ids (byte + 1) as uint16, cut to ``max_len``; also whether it was cut."""
    ids = np.frombuffer(data, dtype=np.uint8)[:max_len].astype(np.uint16)
    ids += 1
    return ids, len(data) > max_len


def strip_padding(ids: np.ndarray, pad_id: int = 0) -> np.ndarray:
    """Drop trailing ``pad_id`` (Skyformer's byte pickles are zero-padded to 4096)."""
    nonpad = np.flatnonzero(np.asarray(ids) != pad_id)
    return np.asarray(ids)[: nonpad[-1] + 1] if nonpad.size else np.asarray(ids)[:0]


class RaggedArray(Sequence):
    """Variable-length token sequences stored back to back in one flat array (in memory
    or a memory-mapped file). ``ra[i]`` is a view; ``ra[a:b]`` or ``ra[index_array]`` is
    another RaggedArray over the same storage. Pickles without the data (workers reopen
    the memory map), so DataLoader workers never copy the whole split."""

    def __init__(
        self,
        starts: np.ndarray,
        lengths: np.ndarray,
        *,
        data: np.ndarray | None = None,
        path: str | os.PathLike | None = None,
        dtype: str | np.dtype = np.uint16,
    ) -> None:
        if (data is None) == (path is None):
            raise ValueError("give exactly one of data and path")
        self.starts = np.asarray(starts, dtype=np.int64)
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self.path = None if path is None else str(path)
        self.dtype = np.dtype(dtype if data is None else data.dtype)
        self._data = data

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], dtype=np.uint16) -> RaggedArray:
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        if not arrays:
            return cls(starts, lengths, data=np.zeros(0, dtype))
        return cls(starts, lengths, data=np.concatenate([np.asarray(a, dtype) for a in arrays]))

    def _storage(self) -> np.ndarray:
        if self._data is None:
            if os.path.getsize(self.path) == 0:
                self._data = np.zeros(0, dtype=self.dtype)
            else:
                self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            i = int(index)
            start, length = self.starts[i], self._lengths[i]
            return self._storage()[start : start + length]
        starts, lengths = self.starts[index], self._lengths[index]
        if self.path is not None:
            return RaggedArray(starts, lengths, path=self.path, dtype=self.dtype)
        return RaggedArray(starts, lengths, data=self._data)

    def lengths(self) -> np.ndarray:
        return self._lengths

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state["_data"] = None
        return state


class RaggedDataset(SequenceDataset):
    """SequenceDataset over a RaggedArray (or a fixed-width 2-D array): lengths come from
    the offsets, not a scan, and ``head(n)`` keeps the type."""

    def lengths(self) -> list[int]:
        if isinstance(self.sequences, RaggedArray):
            return self.sequences.lengths().tolist()
        return super().lengths()

    def head(self, n: int) -> RaggedDataset:
        return type(self)(self.sequences[:n], self.labels[:n])


def check_source(source: str) -> None:
    if source not in ("auto", "raw", "skyformer"):
        raise ValueError(f"source must be auto, raw or skyformer; got {source!r}")


class LRADataModule(SequenceDataModule):
    """What the LRA DataModules add to SequenceDataModule: type-keeping subsets, the token
    cache location, the choice between the raw files
    and Skyformer's pickles, and malformed rows skipped or refused.

    Args:
        source: ``raw`` (public files), ``skyformer`` (Skyformer pickles) or ``auto``
            (raw if present, else Skyformer).
        skip_malformed: skip malformed rows and log their count instead of raising.
        use_cache: tokenise once into a memory-mapped cache (else keep tokens in memory).
        cache_dir: cache folder (default: ``<data_dir>/.cache``).
    """

    def __init__(
        self,
        *,
        source: Literal["auto", "raw", "skyformer"] = "auto",
        skip_malformed: bool = False,
        use_cache: bool = True,
        cache_dir: str | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        check_source(source)
        self.source = source
        self.skip_malformed = skip_malformed
        self.cache_root = resolve_cache_root(self.data_dir, use_cache, cache_dir)

    def _subset(self, ds: SequenceDataset, split: str) -> SequenceDataset:
        n = self.sizes[split]
        if n is None or n >= len(ds):
            return ds
        if isinstance(ds, RaggedDataset):
            return ds.head(n)
        return super()._subset(ds, split)

    def token_cache(self, task: str) -> TokenCache:
        return TokenCache(self.cache_root, task)

    def _found_source(self, raw_found: bool, skyformer_names: Sequence[str]) -> str | None:
        """``raw`` or ``skyformer``, the first that ``self.source`` allows and that is there."""
        if self.source in ("auto", "raw") and raw_found:
            return "raw"
        if self.source in ("auto", "skyformer") and find_skyformer(self.data_dir, skyformer_names):
            return "skyformer"
        return None

    def _no_skyformer(self, what: str, skyformer_names: Sequence[str]) -> MissingDataError:
        """The error for ``source="skyformer"`` without the pickles."""
        return MissingDataError(
            f"{what}, Skyformer pickles",
            skyformer_expected(self.data_dir, skyformer_names),
            f"See {SKYFORMER_URL}",
        )

    def _or_skyformer(self, skyformer_names: Sequence[str]) -> str:
        """How a missing-data message under ``source="auto"`` names the pickles."""
        folder = self.data_dir / "lra_processed"
        return f"or put Skyformer's {skyformer_names[0]}.*.pickle in {folder}"

    def _bad(self, path: Path, line: int | None, problem: str, stats: dict) -> None:
        if not self.skip_malformed:
            raise DataFormatError(path, line, problem)
        stats["skipped"] += 1


class ByteDataModule(LRADataModule):
    """Text and Retrieval: UTF-8 bytes, id = byte + 1, pad 0, 2 classes, a token cache. The
    other constructor arguments go on to LRADataModule.

    Args:
        max_len: bytes kept per sequence (LRA: 4000; Retrieval: per document); longer
            ones are cut.
    """

    def __init__(self, *, max_len: int = 4000, **lra: Any) -> None:
        super().__init__(**lra)
        if not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"max_len must be a positive integer; got {max_len!r}")
        self.vocab_size = 257
        self.num_classes = 2
        self.max_len = max_len
        self.pad_id = 0

    def _encode(self, data: bytes, stats: dict) -> np.ndarray:
        ids, cut = encode_bytes(data, self.max_len)
        stats["truncated"] += int(cut)
        return ids


def resolve_cache_root(data_dir: Path, use_cache: bool, cache_dir: str | None) -> Path | None:
    if not use_cache:
        return None
    return Path(cache_dir).expanduser() if cache_dir else data_dir / ".cache"


def fingerprint(files: Iterable[Path], settings: dict) -> str:
    """Hash of the settings and each file's path, size and modification time."""
    h = hashlib.sha1()
    h.update(json.dumps({"version": CACHE_VERSION, **settings}, sort_keys=True).encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class TokenCache:
    """Build-once, memory-map-after cache of tokenised documents for one task."""

    def __init__(self, root: Path | None, task: str) -> None:
        # root None: keep everything in memory (used when the cache folder is not writable).
        self.dir = None if root is None else root / task

    def load_or_build(
        self,
        split: str,
        key: str,
        build: Callable[[dict], Iterator[tuple[tuple[np.ndarray, ...], int]]],
        *,
        fields: int,
        dtype=np.uint16,
    ) -> tuple[list[RaggedArray], np.ndarray, dict, bool]:
        """Return (one RaggedArray per field, labels, stats, loaded_from_cache).

        ``build(stats)`` yields ``((tokens_field_0, ...), label)`` and may count things
        (truncated, skipped, …) in ``stats``; the counts are stored with the entry so a
        later run can report them without re-reading the sources."""
        if self.dir is not None:
            stem = self.dir / f"{split}-{key}"
            if stem.with_suffix(".json").exists():
                try:
                    return (*self._load(stem, fields), True)
                except (OSError, ValueError, KeyError) as err:
                    log.warning("damaged cache entry %s (%s); rebuilding it", stem, err)
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                return (*self._write(stem, split, build, fields, dtype), False)
            except OSError as err:
                log.warning(
                    "cannot write the token cache in %s (%s); keeping it in memory", self.dir, err
                )
        return (*self._in_memory(build, fields, dtype), False)

    @staticmethod
    def _load(stem: Path, fields: int) -> tuple[list[RaggedArray], np.ndarray, dict]:
        meta = json.loads(stem.with_suffix(".json").read_text())
        offsets = np.load(f"{stem}.idx.npy")
        labels = np.load(f"{stem}.labels.npy")
        arrays = [
            RaggedArray(
                offsets[f, :-1],
                np.diff(offsets[f]),
                path=f"{stem}.tok{f}.bin",
                dtype=meta["dtype"],
            )
            for f in range(fields)
        ]
        return arrays, labels, meta["stats"]

    def _write(self, stem: Path, split: str, build, fields: int, dtype):
        remove_stale_temporaries(self.dir)  # a writer killed outright (SIGKILL) left them
        tmp = f".tmp{os.getpid()}"
        bins = [Path(f"{stem}.tok{f}.bin{tmp}") for f in range(fields)]
        offsets: list[list[int]] = [[0] for _ in range(fields)]
        labels: list[int] = []
        stats: dict = {}
        handles = [open(p, "wb") for p in bins]
        try:
            for tokens, label in build(stats):
                for f, t in enumerate(tokens):
                    handles[f].write(np.ascontiguousarray(t, dtype=dtype).tobytes())
                    offsets[f].append(offsets[f][-1] + len(t))
                labels.append(label)
        except BaseException:
            for h, p in zip(handles, bins):
                h.close()
                p.unlink(missing_ok=True)
            raise
        for h in handles:
            h.close()
        idx_tmp, lab_tmp = Path(f"{stem}.idx.npy{tmp}"), Path(f"{stem}.labels.npy{tmp}")
        with open(idx_tmp, "wb") as fh:
            np.save(fh, np.asarray(offsets, dtype=np.int64))
        with open(lab_tmp, "wb") as fh:
            np.save(fh, np.asarray(labels, dtype=np.int64))
        for f, p in enumerate(bins):
            os.replace(p, f"{stem}.tok{f}.bin")
        os.replace(idx_tmp, f"{stem}.idx.npy")
        os.replace(lab_tmp, f"{stem}.labels.npy")
        meta = {
            "version": CACHE_VERSION,
            "dtype": np.dtype(dtype).name,
            "n": len(labels),
            "stats": stats,
        }
        json_tmp = Path(f"{stem}.json{tmp}")
        json_tmp.write_text(json.dumps(meta))
        os.replace(json_tmp, stem.with_suffix(".json"))
        # Older entries of this split are stale now.
        for old in self.dir.glob(f"{split}-*"):
            if not old.name.startswith(stem.name) and ".tmp" not in old.name:
                old.unlink(missing_ok=True)
        arrays, labels_arr, stats = self._load(stem, fields)
        return arrays, labels_arr, stats

    @staticmethod
    def _in_memory(build, fields: int, dtype):
        stats: dict = {}
        columns: list[list[np.ndarray]] = [[] for _ in range(fields)]
        labels: list[int] = []
        for tokens, label in build(stats):
            for f, t in enumerate(tokens):
                columns[f].append(np.asarray(t, dtype=dtype))
            labels.append(label)
        arrays = [RaggedArray.from_arrays(c, dtype) for c in columns]
        return arrays, np.asarray(labels, dtype=np.int64), stats


def progress(iterable: Iterable, *, total: int | None, desc: str, unit: str = "doc"):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, mininterval=1.0, leave=False)


def find_skyformer(data_dir: Path, names: Sequence[str]) -> dict[str, Path] | None:
    """Skyformer pickles ``<name>.{train,dev,test}.pickle`` in ``data_dir/lra_processed/``
    (Skyformer's own folder) or ``data_dir/``; the first name with a complete set wins."""
    for folder in (data_dir / "lra_processed", data_dir):
        for name in names:
            paths = {s: folder / f"{name}.{SKYFORMER_SPLIT[s]}.pickle" for s in SPLITS}
            if all(p.is_file() for p in paths.values()):
                return paths
    return None


def skyformer_expected(data_dir: Path, names: Sequence[str]) -> list[Path]:
    return [data_dir / "lra_processed" / f"{names[0]}.{SKYFORMER_SPLIT[s]}.pickle" for s in SPLITS]


def read_skyformer(path: Path, fields: int) -> list[tuple[tuple[np.ndarray, ...], int]]:
    """Unpickle a Skyformer split (trusted local file only) and check its structure."""
    with open(path, "rb") as fh:
        try:
            items = pickle.load(fh)  # noqa: S301 - a local file the user pointed us to
        except Exception as err:
            raise DataFormatError(path, None, f"not a readable pickle ({err})") from err
    if not isinstance(items, list):
        raise DataFormatError(path, None, f"expected a list of dicts, got {type(items).__name__}")
    keys = [f"input_ids_{f}" for f in range(fields)]
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or any(k not in item for k in (*keys, "label")):
            raise DataFormatError(path, None, f"item {i}: expected keys {keys + ['label']}")
        try:
            tokens = tuple(np.asarray(item[k]).reshape(-1) for k in keys)
            label = int(item["label"])
        except (TypeError, ValueError) as err:
            raise DataFormatError(path, None, f"item {i}: {err}") from err
        out.append((tokens, label))
    return out
