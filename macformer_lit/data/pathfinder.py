"""LRA Pathfinder: are the two circles joined by a dashed contour? (Linsley et al., 2018)

Follows the LRA reader of the released images (``lra_benchmarks/data/pathfinder.py`` and
``get_pathfinder_base_datasets`` in ``lra_benchmarks/image/input_pipeline.py`` of
https://github.com/google-research/long-range-arena): every ``metadata/<n>.npy`` — a
*text* file despite its name — holds one line per image, fields split on spaces, the
image at ``<field 0>/<field 1>`` (``imgs/<n>/sample_<j>.png``) and the label in field 3
(0-based). Zero-byte images (the release has some) are skipped, as LRA's
``tf.strings.length(image) > 0`` filter does, and counted in the log. Pixels are the PNG's
gray values, row-major: tokens 0..255 (vocabulary 256), length resolution² (1024), two
classes; masks are all True and ``pad_id`` (0) is nominal.

Split: 80 / 10 / 10 % of the valid images (LRA's ``[:80%]``, ``[80%:90%]``, ``[90%:]``),
after a shuffle fixed by ``split_seed`` (metadata files in numeric order, lines in file
order), so it is the same on every run and machine.

Sources, looked for under ``data_dir`` (``source="auto"`` takes the first found):

1. ``raw``: ``pathfinder32/curv_contour_length_14/{imgs,metadata}`` from
   ``lra_release.gz`` (``difficulty`` hard; ``intermediate`` = ``curv_contour_length_9``,
   ``easy`` = ``curv_baseline``; other resolutions: ``pathfinder{64,128,256}``), also found
   under ``lra_release/`` or ``lra_release/lra_release/`` (the archive unpacked as is).
2. ``skyformer``: ``lra_processed/lra-pathfinder32-curv_contour_length_14.{train,dev,
   test}.pickle`` or ``lra-pathfinder.*.pickle`` (Skyformer's ``create_pathfinder.py``,
   their own random split). Pickles run code when loaded: they are read only from the
   ``data_dir`` you name; never point it at files from an untrusted source.

``generate=True`` writes ``generate_size`` images with
:mod:`macformer_lit.data.pathfinder_generator` into the raw folder when it has no metadata
(32×32 only; a ``generator.json`` there records the settings, and every load logs that
the data are generated). Off by default: the real set has 200,000 images, and a model
trained on a small generated set is not comparable with published numbers.

Decoded pixels are cached (memory-mapped uint8) under ``data_dir/.cache/``; the cache key
covers the metadata files and the image folders' listings, not the PNGs' contents.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from macformer_lit.data.common import (
    DataFormatError,
    MissingDataError,
    SequenceDataset,
    check_positive,
)
from macformer_lit.data.lra_files import (
    LRA_URL,
    LRADataModule,
    RaggedDataset,
    find_skyformer,
    fingerprint,
    lra_release_candidates,
    progress,
    read_skyformer,
)

log = logging.getLogger(__name__)

DIFFICULTY_FOLDERS = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
CONTOUR_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}
SPLIT_FRACTIONS = (0.8, 0.9)


class PathfinderDataModule(LRADataModule):
    """Pathfinder images as pixel sequences; batches ``{"input_ids", "padding_mask",
    "labels"}`` with L = resolution² and all-True masks.

    The other constructor arguments are LRADataModule's and its bases'.

    Args:
        data_dir: folder holding LRA's ``pathfinder<resolution>/`` folders (or Skyformer's
            pickles); generated images go there too.
        batch_size: training batch size.
        resolution: image side: 32 (LRA Pathfinder), 64, 128 (Path-X) or 256.
        difficulty: ``hard`` (contour length 14, LRA's), ``intermediate`` (9), ``easy`` (6).
        split_seed: seed of the fixed shuffle before the 80/10/10 split.
        generate: generate ``generate_size`` images when the folder has none (32×32 only).
        generate_size: number of images to generate.
        generate_seed: seed of the generator.
        generate_workers: generator processes (default: all cores).
    """

    def __init__(
        self,
        *,
        data_dir: str = "data/lra",
        batch_size: int = 128,
        resolution: int = 32,
        difficulty: Literal["easy", "intermediate", "hard"] = "hard",
        split_seed: int = 0,
        generate: bool = False,
        generate_size: int = 10000,
        generate_seed: int = 0,
        generate_workers: int | None = None,
        **lra: Any,
    ) -> None:
        super().__init__(data_dir=data_dir, batch_size=batch_size, **lra)
        if resolution not in (32, 64, 128, 256):
            raise ValueError(f"resolution must be 32, 64, 128 or 256; got {resolution!r}")
        if difficulty not in DIFFICULTY_FOLDERS:
            raise ValueError(
                f"difficulty must be one of {list(DIFFICULTY_FOLDERS)}; got {difficulty!r}"
            )
        if generate and resolution != 32:
            raise ValueError("generate=True supports resolution 32 only (the LRA 32×32 parameters)")
        check_positive("generate_size", generate_size, allow_none=False)
        check_positive("generate_workers", generate_workers)
        self.vocab_size = 256
        self.num_classes = 2
        self.max_len = resolution * resolution
        # Nominal: sequences all have length resolution², nothing is ever padded.
        self.pad_id = 0
        self.resolution = resolution
        self.difficulty = difficulty
        self.split_seed = split_seed
        self.generate = generate
        self.generate_size = generate_size
        self.generate_seed = generate_seed
        self.generate_workers = generate_workers
        self._all: tuple | None = None

    @property
    def _relative(self) -> str:
        return f"pathfinder{self.resolution}/{DIFFICULTY_FOLDERS[self.difficulty]}"

    @property
    def _skyformer_names(self) -> tuple[str, ...]:
        names = (f"lra-pathfinder{self.resolution}-{DIFFICULTY_FOLDERS[self.difficulty]}",)
        if self.resolution == 32 and self.difficulty == "hard":
            # The task name in Skyformer's README and shared files.
            names += ("lra-pathfinder",)
        return names

    def _raw_folder(self) -> Path | None:
        for folder in lra_release_candidates(self.data_dir, self._relative):
            if (folder / "metadata").is_dir() and any((folder / "metadata").glob("*.npy")):
                return folder
        return None

    def _resolve(self) -> tuple[str, Path | None]:
        folder = self._raw_folder()
        found = self._found_source(folder is not None, self._skyformer_names)
        if found:
            return found, folder if found == "raw" else None
        if self.source != "skyformer" and self.generate:
            return "raw", self._generate()
        if self.source == "skyformer":
            raise self._no_skyformer("LRA Pathfinder", self._skyformer_names)
        target = self.data_dir / self._relative
        how = (
            f"Download the LRA release ({LRA_URL}, 7.7 GB) and unpack it into {self.data_dir}:\n"
            f"  mkdir -p {self.data_dir} && "
            f"tar -xzf lra_release.gz -C {self.data_dir} --strip-components=1\n"
            "or generate a set in the same layout:\n"
            f"  python -m macformer_lit.data.pathfinder_generator --out {target} --num 200000\n"
            "(or pass generate=True to generate generate_size images on first use)"
        )
        raise MissingDataError(
            f"LRA Pathfinder-{self.resolution} ({self.difficulty})",
            [target / "imgs", target / "metadata"],
            how,
        )

    def _generate(self) -> Path:
        from macformer_lit.data.pathfinder_generator import PathfinderParams, generate_pathfinder

        folder = self.data_dir / self._relative
        params = PathfinderParams(contour_length=CONTOUR_LENGTHS[self.difficulty])
        log.warning(
            "Pathfinder: no data in %s; generating %d images (seed %d) there",
            folder,
            self.generate_size,
            self.generate_seed,
        )
        stats = generate_pathfinder(
            folder,
            self.generate_size,
            seed=self.generate_seed,
            params=params,
            workers=self.generate_workers,
        )
        (folder / "generator.json").write_text(
            json.dumps({"seed": self.generate_seed, "num": self.generate_size, **stats}, indent=1)
        )
        return folder

    def prepare_data(self) -> None:
        # Rank 0 generates/decodes once; the other ranks then only memory-map the cache.
        self._load_all()

    def load_split(self, split: str) -> SequenceDataset:
        kind, pixels, labels, order = self._load_all()
        if kind == "skyformer":
            return self._skyformer_split(split)
        n = len(labels)
        a, b = (int(f * n) for f in SPLIT_FRACTIONS)
        index = {"train": order[:a], "val": order[a:b], "test": order[b:]}[split]
        return RaggedDataset(pixels[index], labels[index])

    def _load_all(self):
        if self._all is not None:
            return self._all
        source, folder = self._resolve()
        if source == "skyformer":
            self._all = ("skyformer", None, None, None)
            return self._all
        generated = folder / "generator.json"
        if generated.exists():
            log.warning(
                "Pathfinder: %s holds GENERATED images (%s), not the LRA release", folder, generated
            )
        metadata = sorted(
            (folder / "metadata").glob("*.npy"),
            key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem),
        )
        image_dirs = sorted(p for p in (folder / "imgs").glob("*") if p.is_dir())
        settings = {
            "task": "pathfinder",
            "resolution": self.resolution,
            "skip_malformed": self.skip_malformed,
        }
        key = fingerprint([*metadata, *image_dirs], settings)

        def build(stats: dict):
            stats.update(images=0, zero_byte=0, skipped=0)
            for pixels, label in progress(
                self._read_raw(folder, metadata, stats),
                total=None,
                desc="decoding Pathfinder",
                unit="img",
            ):
                stats["images"] += 1
                yield (pixels,), label

        cache = self.token_cache(
            f"pathfinder{self.resolution}-{DIFFICULTY_FOLDERS[self.difficulty]}"
        )
        (pixels,), labels, stats, cached = cache.load_or_build(
            "all", key, build, fields=1, dtype=np.uint8
        )
        log.info(
            "Pathfinder %s: %d images%s; split 80/10/10 %% with split_seed=%d",
            folder,
            len(labels),
            " (from cache)" if cached else "",
            self.split_seed,
        )
        if stats["zero_byte"]:
            log.warning("Pathfinder: skipped %d zero-byte images (as LRA does)", stats["zero_byte"])
        if stats["skipped"]:
            log.warning(
                "Pathfinder: skipped %d malformed entries (skip_malformed=True)", stats["skipped"]
            )
        if len(labels) < 10:
            raise DataFormatError(
                folder, None, f"only {len(labels)} usable images; need at least 10"
            )
        order = np.random.default_rng(self.split_seed).permutation(len(labels))
        self._all = ("raw", pixels, labels, order)
        return self._all

    def _read_raw(self, folder: Path, metadata: list[Path], stats: dict):
        shape = (self.resolution, self.resolution)
        for meta in metadata:
            with open(meta, encoding="utf-8") as fh:
                for line_no, line in enumerate(fh, start=1):
                    fields = line.split()
                    if not fields:
                        continue
                    if len(fields) < 4 or fields[3] not in ("0", "1"):
                        self._bad(
                            meta, line_no, "expected '<dir> <file> <n> <label 0|1> ...'", stats
                        )
                        continue
                    image = folder / fields[0] / fields[1]
                    try:
                        size = image.stat().st_size
                    except OSError:
                        self._bad(meta, line_no, f"image {image} not found", stats)
                        continue
                    if size == 0:
                        stats["zero_byte"] += 1
                        continue
                    try:
                        with Image.open(image) as im:
                            pixels = np.asarray(im.convert("L"))
                    except (OSError, UnidentifiedImageError) as err:
                        self._bad(meta, line_no, f"cannot decode {image}: {err}", stats)
                        continue
                    if pixels.shape != shape:
                        self._bad(
                            meta, line_no, f"{image} is {pixels.shape}, expected {shape}", stats
                        )
                        continue
                    yield pixels.reshape(-1), int(fields[3])

    def _skyformer_split(self, split: str) -> SequenceDataset:
        path = find_skyformer(self.data_dir, self._skyformer_names)[split]
        items = read_skyformer(path, fields=1)
        pixels = np.zeros((len(items), self.max_len), dtype=np.uint8)
        labels = np.zeros(len(items), dtype=np.int64)
        for i, ((ids,), label) in enumerate(items):
            if ids.shape != (self.max_len,) or ids.min() < 0 or ids.max() > 255:
                raise DataFormatError(
                    path, None, f"item {i}: expected {self.max_len} pixel values 0..255"
                )
            if label not in (0, 1):
                raise DataFormatError(path, None, f"item {i}: label {label} not 0/1")
            pixels[i], labels[i] = ids, label
        log.info("Pathfinder %s: %d images (Skyformer pickle %s)", split, len(labels), path.name)
        return RaggedDataset(pixels, labels)
