"""LRA Retrieval (AAN): the release's TSV files (quoting off), Skyformer pickles, pair batches."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from macformer_lit.data.common import DataFormatError, MissingDataError
from macformer_lit.data.retrieval import RetrievalDataModule

MAX_LEN = 40
ROWS = {
    "train": [
        ("1.0", "p1", "p2", '"Quoted start, no closing quote', "second doc"),
        ("0.0", "p3", "p4", "short", "x" * 55),  # longer than MAX_LEN
        ("1.0", "p5", "p6", "caf\u00e9", 'ends with a quote"'),
    ],
    "eval": [("0.0", "p7", "p8", "eval one", "eval two")],
    "test": [("1.0", "p9", "p10", "test one", "test two"), ("0.0", "a", "b", "c", "d")],
}


def write_tsv(root, rows=ROWS, extra: dict | None = None):
    folder = root / "tsv_data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        lines = ["\t".join(r) for r in items] + (extra or {}).get(split, [])
        (folder / f"new_aan_pairs.{split}.tsv").write_bytes(("\n".join(lines) + "\n").encode())
    return folder


def ids(text: str, max_len=MAX_LEN):
    return tuple(b + 1 for b in text.encode("utf-8")[:max_len])


def contents(ds):
    out = []
    for i in range(len(ds)):
        (a, b), y = ds[i]
        out.append((tuple(int(t) for t in a), tuple(int(t) for t in b), int(y)))
    return out


def test_attributes_known_without_data(tmp_path):
    dm = RetrievalDataModule(data_dir=str(tmp_path))
    assert (dm.vocab_size, dm.num_classes, dm.max_len, dm.pad_id) == (257, 2, 4000, 0)


def test_tsv_pairs_quotes_labels_truncation(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="macformer_lit")
    write_tsv(tmp_path)
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN, batch_size=3)
    dm.setup("fit")
    # A field starting with '"' is kept verbatim (quoting off), labels '1.0' → 1.
    assert contents(dm.datasets["train"]) == [
        (ids(r[3]), ids(r[4]), int(float(r[0]))) for r in ROWS["train"]
    ]
    assert "1 documents longer than max_len=40 were truncated" in caplog.text
    assert contents(dm.datasets["val"]) == [(ids("eval one"), ids("eval two"), 0)]

    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {
        "input_ids_0",
        "padding_mask_0",
        "input_ids_1",
        "padding_mask_1",
        "labels",
    }
    loader = DataLoader(dm.datasets["train"], batch_size=3, collate_fn=dm.collate())
    batch = next(iter(loader))
    # Each side is padded to its own longest document.
    # Each side padded to its longest document rounded up to 64 bytes, at most max_len.
    longest = max(len(r[3].encode()) for r in ROWS["train"])
    assert batch["input_ids_0"].shape == (3, min(-(-longest // 64) * 64, MAX_LEN))
    assert batch["input_ids_1"].shape == (3, MAX_LEN)
    for side in "01":
        assert batch[f"input_ids_{side}"].dtype == torch.long
        assert batch[f"padding_mask_{side}"].dtype == torch.bool
        mask = batch[f"padding_mask_{side}"]
        assert (batch[f"input_ids_{side}"][~mask] == 0).all()
    assert batch["padding_mask_0"].sum(1).tolist() == [len(r[3].encode()) for r in ROWS["train"]]
    assert batch["labels"].tolist() == [1, 0, 1]


def test_malformed_row_names_file_and_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="macformer_lit")
    write_tsv(tmp_path, extra={"train": ["1.0\tonly\tfour\tfields", "maybe\ta\tb\tc\td"]})
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN)
    with pytest.raises(DataFormatError, match=r"new_aan_pairs\.train\.tsv:4: expected 5"):
        dm.setup("fit")
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN, skip_malformed=True)
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 3
    assert "skipped 2 malformed rows" in caplog.text


def test_release_unpacked_with_top_folder_and_subsets(tmp_path):
    write_tsv(tmp_path / "lra_release")
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN, train_size=2, test_size=1)
    dm.setup()
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [2, 1, 1]
    assert len(list(dm.test_dataloader())) == 1


def test_cache_is_memory_mapped_and_reused(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="macformer_lit")
    write_tsv(tmp_path)
    RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN).prepare_data()
    caplog.clear()
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN)
    dm.setup("fit")
    assert caplog.text.count("from cache") == 2
    ds = dm.datasets["train"]
    assert isinstance(ds[0][0][0], np.memmap) or isinstance(ds[0][0][0].base, np.memmap)
    assert contents(ds)[0] == (ids(ROWS["train"][0][3]), ids(ROWS["train"][0][4]), 1)


def test_skyformer_pickles(tmp_path):
    folder = tmp_path / "lra_processed"
    folder.mkdir()
    for split in ("train", "dev", "test"):
        items = [
            {
                "input_ids_0": np.concatenate([np.array(ids(f"{split} a")), np.zeros(96, int)]),
                "input_ids_1": np.concatenate([np.array(ids("b" * 50, 50)), np.zeros(96, int)]),
                "label": np.int32(1),
            }
        ]
        (folder / f"lra-retrieval.{split}.pickle").write_bytes(pickle.dumps(items))
    dm = RetrievalDataModule(data_dir=str(tmp_path), max_len=MAX_LEN)
    dm.setup("fit")
    assert contents(dm.datasets["val"]) == [(ids("dev a"), ids("b" * 50), 1)]


def test_missing_data_names_files_and_download(tmp_path):
    with pytest.raises(MissingDataError) as err:
        RetrievalDataModule(data_dir=str(tmp_path)).setup("fit")
    message = str(err.value)
    assert "tsv_data/new_aan_pairs.train.tsv" in message
    assert "tsv_data/new_aan_pairs.eval.tsv" in message
    assert "storage.googleapis.com/long-range-arena/lra_release.gz" in message
