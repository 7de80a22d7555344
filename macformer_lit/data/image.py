"""LRA Image: CIFAR-10 as sequences of 1024 grayscale pixels (Krizhevsky, 2009).

Follows ``get_cifar10_datasets`` in ``lra_benchmarks/image/input_pipeline.py`` of
https://github.com/google-research/long-range-arena: ``tf.image.rgb_to_grayscale`` and
integer pixel tokens (vocabulary 256), 10 classes, train/val/test 45,000 / 5,000 / 10,000.

Grayscale, as TensorFlow computes it (``rgb_to_grayscale`` then ``convert_image_dtype``
back to uint8), in float32::

    y = (0.2989 · R/255 + 0.5870 · G/255 + 0.1140 · B/255) · 255.5, truncated to an integer

(equal to TensorFlow's up to float32 rounding at integer boundaries). Tokens are row-major
pixels, 0..255; every sequence has length 1024, so masks are all True and ``pad_id`` (0)
is nominal: pixel 0 is a real token, never padding.

Split: LRA takes ``train[:90%]`` / ``train[90%:]`` of the TFDS ``cifar10`` training set.
TFDS stores CIFAR-10 in its own shuffled order, so the exact images differ; here the
validation set is the **last 5,000 training images** of the python batches
(``data_batch_5[5000:]``; ``val_holdout`` changes the count), training the first 45,000,
test ``test_batch``.

Sources, looked for under ``data_dir`` (``source="auto"`` takes the first found):

1. ``raw``: ``cifar-10-batches-py/{data_batch_1..5,test_batch}``, the unpacked
   ``cifar-10-python.tar.gz``: pickled dicts with ``b"data"`` (10000 × 3072 uint8, the
   R, G and B planes one after the other) and ``b"labels"``.
2. ``skyformer``: ``lra_processed/lra-image.{train,dev,test}.pickle`` (or directly in
   ``data_dir``) from Skyformer's ``create_cifar10.py`` (their own split).

Both are Python pickles: unpickling runs code from the file, so these are only read from
the ``data_dir`` the user names; never point it at files from an untrusted source.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from macformer_lit.data.common import (
    DataFormatError,
    MissingDataError,
    SequenceDataset,
    check_positive,
)
from macformer_lit.data.lra_files import (
    CIFAR10_URL,
    LRADataModule,
    RaggedDataset,
    find_skyformer,
    read_skyformer,
)

log = logging.getLogger(__name__)

SKYFORMER_NAMES = ("lra-image",)
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
# tf.image.rgb_to_grayscale's weights.
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)


def rgb_to_gray_tf(planes: np.ndarray) -> np.ndarray:
    """(N, 3, P) uint8 colour planes → (N, P) uint8, as TensorFlow's grayscale + cast."""
    x = planes.astype(np.float32) * np.float32(1.0 / 255)
    gray = x[:, 0] * GRAY_WEIGHTS[0] + x[:, 1] * GRAY_WEIGHTS[1] + x[:, 2] * GRAY_WEIGHTS[2]
    # convert_image_dtype(float → uint8) multiplies by 255.5 and casts (truncates).
    return (gray * np.float32(255.5)).astype(np.uint8)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch → ((n, 1024) uint8 gray pixels, (n,) int64 labels)."""
    with open(path, "rb") as fh:
        try:
            batch = pickle.load(fh, encoding="bytes")  # noqa: S301 - the user's own file
        except Exception as err:
            raise DataFormatError(path, None, f"not a CIFAR-10 python batch ({err})") from err
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataFormatError(path, None, 'expected a dict with b"data" and b"labels"')
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataFormatError(
            path, None, f"b'data' must be (n, 3072) uint8; got {data.shape} {data.dtype}"
        )
    if labels.shape != (data.shape[0],) or labels.min(initial=0) < 0 or labels.max(initial=0) > 9:
        raise DataFormatError(path, None, "b'labels' must hold one class 0..9 per image")
    return rgb_to_gray_tf(data.reshape(-1, 3, 1024)), labels


class ImageDataModule(LRADataModule):
    """CIFAR-10 grayscale pixel sequences; batches ``{"input_ids", "padding_mask", "labels"}``
    with L = 1024 and all-True masks.

    The other constructor arguments are LRADataModule's and its bases'.

    Args:
        data_dir: folder holding ``cifar-10-batches-py/`` (or Skyformer's pickles).
        batch_size: training batch size.
        val_holdout: training images held out (from the end) for validation (LRA: 5000).
    """

    def __init__(
        self,
        *,
        data_dir: str = "data/lra",
        batch_size: int = 256,
        val_holdout: int = 5000,
        **lra: Any,
    ) -> None:
        # CIFAR-10's pickles are read whole: no rows to skip, no token cache.
        super().__init__(
            data_dir=data_dir,
            batch_size=batch_size,
            skip_malformed=False,
            use_cache=False,
            cache_dir=None,
            **lra,
        )
        self.vocab_size = 256
        self.num_classes = 10
        self.max_len = 1024
        # Nominal: sequences all have length 1024, nothing is ever padded.
        self.pad_id = 0
        check_positive("val_holdout", val_holdout, allow_none=False)
        self.val_holdout = val_holdout
        self._train_pool: tuple[np.ndarray, np.ndarray] | None = None

    def _folder(self) -> Path:
        return self.data_dir / "cifar-10-batches-py"

    def _resolve(self) -> str:
        folder = self._folder()
        raw_files = [folder / n for n in (*TRAIN_BATCHES, "test_batch")]
        found = self._found_source(all(p.is_file() for p in raw_files), SKYFORMER_NAMES)
        if found:
            return found
        if self.source == "skyformer":
            raise self._no_skyformer("LRA Image", SKYFORMER_NAMES)
        how = (
            f"Download CIFAR-10, python version ({CIFAR10_URL}) and unpack it into "
            f"{self.data_dir}:\n  mkdir -p {self.data_dir} && "
            f"tar -xzf cifar-10-python.tar.gz -C {self.data_dir}"
        )
        if self.source == "auto":
            how += "\n" + self._or_skyformer(SKYFORMER_NAMES)
        raise MissingDataError(
            "LRA Image (CIFAR-10)", [p for p in raw_files if not p.is_file()], how
        )

    def load_split(self, split: str) -> SequenceDataset:
        source = self._resolve()
        if source == "skyformer":
            path = find_skyformer(self.data_dir, SKYFORMER_NAMES)[split]
            pixels, labels = self._read_skyformer(path)
        elif split == "test":
            pixels, labels = read_cifar_batch(self._folder() / "test_batch")
        else:
            if self._train_pool is None:
                parts = [read_cifar_batch(self._folder() / n) for n in TRAIN_BATCHES]
                self._train_pool = (
                    np.concatenate([p for p, _ in parts]),
                    np.concatenate([y for _, y in parts]),
                )
            pool_x, pool_y = self._train_pool
            cut = len(pool_y) - self.val_holdout
            if cut <= 0:
                raise DataFormatError(
                    self._folder(),
                    None,
                    f"only {len(pool_y)} training images for val_holdout={self.val_holdout}",
                )
            pixels, labels = (
                (pool_x[:cut], pool_y[:cut]) if split == "train" else (pool_x[cut:], pool_y[cut:])
            )
        log.info("CIFAR-10 %s: %d images (%s)", split, len(labels), source)
        return RaggedDataset(pixels, labels)

    def _read_skyformer(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        items = read_skyformer(path, fields=1)
        pixels = np.zeros((len(items), self.max_len), dtype=np.uint8)
        labels = np.zeros(len(items), dtype=np.int64)
        for i, ((ids,), label) in enumerate(items):
            if ids.shape != (self.max_len,) or ids.min() < 0 or ids.max() > 255:
                raise DataFormatError(path, None, f"item {i}: expected 1024 pixel values 0..255")
            if not 0 <= label < self.num_classes:
                raise DataFormatError(path, None, f"item {i}: label {label} not in 0..9")
            pixels[i], labels[i] = ids, label
        return pixels, labels
