"""ListOps: generator fidelity, tokenisers, TSV reader and DataModule.

Labels are checked against an independent evaluator of LRA's pair form (LRA's ``to_value``
semantics, written afresh here). Lengths are checked against the exact length
distribution of LRA's generator, computed here by dynamic programming from docs/data.md §4, and
labels against the frequencies stated there; tolerances are 4 standard errors of the sample size.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from macformer_lit.data.common import DataFormatError, MissingDataError
from macformer_lit.data.listops import (
    MANIFEST_NAME,
    SOURCE_TOKENS,
    ListOpsDataModule,
    ListOpsTokenizer,
    _source_units_fast,
    read_tsv,
)
from macformer_lit.data.listops_generator import (
    SPLITS,
    ListOpsParams,
    generate_block,
    generate_examples,
    write_tsv_files,
)

N_SAMPLE = 3000
# 4 standard errors: a correct generator fails a given check about once in 16,000 runs.
Z = 4.0

_OPEN = object()
_FUNCTIONS = {
    "[MIN": min,
    "[MAX": max,
    "[MED": lambda args: int(statistics.median(args)),
    "[SM": lambda args: sum(args) % 10,
}


def evaluate(expression: str) -> tuple[int, int]:
    """(value, length) of an expression in LRA's pair form ``( a b )``.

    Every pair is reduced as LRA's ``to_value`` does: ``(op, x)`` starts an argument list,
    ``(list, x)`` extends it, ``(list, ])`` applies the operator. Asserts the form is exact.
    """
    stack: list = []
    length = 0
    for token in expression.split(" "):
        if token == "(":
            stack.append(_OPEN)
        elif token == ")":
            right, left, opener = stack.pop(), stack.pop(), stack.pop()
            assert opener is _OPEN
            if isinstance(left, str):
                assert left in _FUNCTIONS and isinstance(right, int)
                stack.append((left, (right,)))
            elif right == "]":
                assert isinstance(left, tuple)
                stack.append(_FUNCTIONS[left[0]](left[1]))
            else:
                assert isinstance(left, tuple) and isinstance(right, int)
                stack.append((left[0], left[1] + (right,)))
        else:
            length += 1
            stack.append(int(token) if token.isdigit() else token)
    assert len(stack) == 1 and isinstance(stack[0], int), "not one complete expression"
    return stack[0], length


def exact_length_pmf() -> np.ndarray:
    """P(length = l) for l < max_length of a tree from LRA's generator; last bin: >= max."""
    p = ListOpsParams()
    cap = p.max_length

    def close(head: np.ndarray) -> np.ndarray:
        """Lengths 0..cap-1 as given, the rest of the mass in the last bin."""
        out = np.zeros(cap + 1)
        out[:cap] = head[:cap]
        out[cap] = 1 - out[:cap].sum()
        return out

    digit = close(np.eye(1, cap, 1)[0])
    pmf = digit  # depth max_depth: always a digit
    for _ in range(p.max_depth - 1):
        operator = np.zeros(cap + 1)
        power = pmf
        for _k in range(2, p.max_args + 1):
            power = close(np.convolve(power[:cap], pmf[:cap]))  # total length of k children
            # The operator and its "]" add 2; the argument count is uniform.
            operator += close(np.concatenate([[0, 0], power[: cap - 2]])) / (p.max_args - 1)
        pmf = (1 - p.value_p) * digit + p.value_p * operator
    return pmf


@pytest.fixture(scope="module")
def exact() -> dict:
    pmf = exact_length_pmf()
    kept = pmf[501:2000]
    cdf = np.cumsum(kept / kept.sum())
    median = 501 + int(np.searchsorted(cdf, 0.5))
    return {"acceptance": kept.sum(), "cdf": cdf, "median": median, "density": kept / kept.sum()}


@pytest.fixture(scope="module")
def sample() -> list[tuple[str, int]]:
    return generate_examples(N_SAMPLE, seed=0)


def test_exact_distribution_matches_spec(exact):
    # docs/data.md §4: about 8 % of trees are kept. The often-quoted "median length ≈ 980"
    # is not what LRA's generator gives: the exact median is 954 (951 measured on 100k trees).
    assert 0.075 < exact["acceptance"] < 0.09
    assert exact["median"] == 954


def test_every_label_equals_an_independent_evaluation(sample):
    for expression, label in sample:
        value, length = evaluate(expression)
        assert value == label
        assert 500 < length < 2000


def test_examples_are_distinct(sample):
    assert len({e for e, _ in sample}) == len(sample)


def test_length_distribution_is_the_exact_one(sample, exact):
    lengths = np.array([sum(t not in "()" for t in e.split(" ")) for e, _ in sample])
    n = len(lengths)
    empirical = np.cumsum(np.bincount(lengths - 501, minlength=1499)[:1499]) / n
    # Kolmogorov-Smirnov at alpha = 0.001 (conservative for a discrete distribution).
    assert np.abs(empirical - exact["cdf"]).max() < 1.95 / np.sqrt(n)
    # Sample median: standard error 1 / (2 f(m) sqrt(n)), f = density at the median.
    se = 1 / (2 * exact["density"][exact["median"] - 501] * np.sqrt(n))
    assert abs(np.median(lengths) - exact["median"]) < Z * se


def test_acceptance_rate_is_the_exact_one(exact):
    params, attempts, blocks = ListOpsParams(), 4096, 8
    kept = sum(len(generate_block(7, "train", b, attempts, params).labels) for b in range(blocks))
    n, p = attempts * blocks, exact["acceptance"]
    assert abs(kept - n * p) < Z * np.sqrt(n * p * (1 - p))


def test_label_distribution_matches_spec(sample):
    labels = np.array([y for _, y in sample])
    n = len(labels)
    share = np.bincount(labels, minlength=10) / n
    # docs/data.md §4: labels 0 and 9 each about 17 %, the majority class about 17.5 %.
    assert set(np.argsort(share)[-2:]) == {0, 9}
    for value, expected in ((share[0], 0.17), (share[9], 0.17), (share.max(), 0.175)):
        assert abs(value - expected) < Z * np.sqrt(expected * (1 - expected) / n)


def _write(tmp_path: Path, name: str, sizes: dict[str, int], **kwargs) -> dict[str, bytes]:
    paths = {s: tmp_path / name / f"basic_{s}.tsv" for s in SPLITS}
    write_tsv_files(paths, sizes, progress=False, attempts_per_block=512, **kwargs)
    return {s: p.read_bytes() for s, p in paths.items()}


def test_generation_is_deterministic_and_prefix_stable(tmp_path):
    sizes = {"train": 120, "val": 20, "test": 20}
    one = _write(tmp_path, "a", sizes, seed=0, processes=1)
    assert one == _write(tmp_path, "b", sizes, seed=0, processes=1)
    assert one == _write(tmp_path, "c", sizes, seed=0, processes=2)
    other = _write(tmp_path, "d", sizes, seed=1, processes=1)
    assert all(one[s] != other[s] for s in SPLITS)
    # LRA's format: csv.writer's header and \r\n line ends, one row per example.
    for s in SPLITS:
        lines = one[s].split(b"\r\n")
        assert lines[0] == b"Source\tTarget" and lines[-1] == b""
        assert len(lines) == sizes[s] + 2
    # A larger request starts with the smaller one: a quick run reads the same rows
    # whether the files on disk were generated for it or for a full run.
    larger = _write(tmp_path, "e", {"train": 200, "val": 30, "test": 30}, seed=0, processes=1)
    assert all(larger[s].startswith(one[s]) for s in SPLITS)
    rows = [r for s in SPLITS for r in one[s].split(b"\r\n")[1:-1]]
    assert len(set(rows)) == len(rows)  # no duplicates across splits


def test_official_and_skyformer_tokenisers():
    official, skyformer = ListOpsTokenizer("official"), ListOpsTokenizer("skyformer")
    assert official.vocab == ("<pad>", "[MIN", "[MAX", "[MED", "[SM", "]", *"0123456789")
    assert skyformer.vocab == ("<pad>", "[MIN", "[MAX", "[MED", "[SM", *"0123456789")

    def words(tokenizer: ListOpsTokenizer, expression: str) -> list[str]:
        ids = tokenizer(expression)
        assert ids.dtype == np.uint8 and (ids > 0).all()
        return [tokenizer.vocab[i] for i in ids]

    simple = "( ( ( [MAX 2 ) 9 ) ] )"
    assert words(official, simple) == ["[MAX", "2", "9", "]"]
    assert words(skyformer, simple) == ["[MAX", "2", "9"]
    # [SM [MIN 5 2] 3 4] = 9 and [SM [MIN 5 2 3] 4] = 6: the official tokens differ, the
    # skyformer tokens are the same, which is why that tokeniser makes the task ambiguous.
    a = "( ( ( ( [SM ( ( ( [MIN 5 ) 2 ) ] ) ) 3 ) 4 ) ] )"
    b = "( ( ( [SM ( ( ( ( [MIN 5 ) 2 ) 3 ) ] ) ) 4 ) ] )"
    assert (evaluate(a)[0], evaluate(b)[0]) == (9, 6)
    assert words(official, a) == ["[SM", "[MIN", "5", "2", "]", "3", "4", "]"]
    assert words(official, b) == ["[SM", "[MIN", "5", "2", "3", "]", "4", "]"]
    assert words(skyformer, a) == words(skyformer, b) == ["[SM", "[MIN", "5", "2", "3", "4"]
    # Irregular whitespace is tolerated; unknown tokens and empty input are not.
    assert words(official, "  ( [MED\t7 )  ] ") == ["[MED", "7", "]"]
    for bad in ("( [MAXX 2 )", "12", "[MIN[MAX 3", "x", "", "   "):
        with pytest.raises(ValueError):
            official(bad)
    with pytest.raises(ValueError, match="skyformer"):
        ListOpsTokenizer("bpe")


def test_fast_tokeniser_path_agrees_with_its_reference(sample):
    rng = random.Random(0)
    pieces = [*SOURCE_TOKENS, "[M", "IN", "MIN", "[MINI", "12", "x", "[", "M", "(1", "]]", "é"]
    separators = [" ", " ", " ", "  ", "\t", ""]
    for _ in range(5000):
        text = "".join(
            rng.choice(pieces) + rng.choice(separators) for _ in range(rng.randint(0, 8))
        )
        raw = text.encode()
        fast = _source_units_fast(raw)
        tokens = [t.decode() for t in raw.split()]
        if fast is not None:
            assert tokens and all(t in SOURCE_TOKENS for t in tokens), text
            assert list(fast) == [SOURCE_TOKENS.index(t) for t in tokens], text
    # The fast path serves every line the generator writes.
    assert all(_source_units_fast(e.encode()) is not None for e, _ in sample[:200])


def _write_tsv(path: Path, lines: list[str], newline: str = "\r\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(line + newline for line in lines).encode())
    return path


def test_read_tsv_official_format(tmp_path):
    rows = ["( ( ( [MAX 2 ) 9 ) ] )\t9", "( ( ( [SM 5 ) 7 ) ] )\t2", "( ( ( [MIN 4 ) 1 ) ] )\t1"]
    official = ListOpsTokenizer("official")
    for newline in ("\r\n", "\n"):
        path = _write_tsv(tmp_path / f"t{len(newline)}.tsv", ["Source\tTarget", *rows], newline)
        sequences, labels = read_tsv(path, official)
        assert labels == [9, 2, 1]
        assert [s.tolist() for s in sequences] == [
            official(r.split("\t")[0]).tolist() for r in rows
        ]
        assert read_tsv(path, official, limit=2)[1] == [9, 2]


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        (["Source,Target", "( ( ( [MAX 2 ) 9 ) ] )\t9"], 1, "header"),
        (["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t9", "( ( ( [MAX 2 ) 9 ) ] )"], 3, "2 tab"),
        (["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t9\t1"], 2, "2 tab"),
        (["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\tnine"], 2, "not an integer"),
        (["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t10"], 2, "outside 0..9"),
        (["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t9", "( ( ( [MAX 2 ) X ) ] )\t9"], 3, "'X'"),
        (["Source\tTarget", "\t3"], 2, "empty"),
    ],
)
def test_read_tsv_rejects_malformed_rows(tmp_path, lines, line, problem):
    path = _write_tsv(tmp_path / "bad.tsv", lines)
    with pytest.raises(DataFormatError, match=problem) as error:
        read_tsv(path, ListOpsTokenizer("official"))
    assert f"{path}:{line}:" in str(error.value)


def _dm(tmp_path: Path, **kwargs) -> ListOpsDataModule:
    options = dict(data_dir=str(tmp_path), generate_processes=1)
    return ListOpsDataModule(**{**options, **kwargs})


def test_missing_files_without_generation(tmp_path):
    dm = _dm(tmp_path, generate=False)
    with pytest.raises(MissingDataError) as error:
        dm.setup("fit")
    message = str(error.value)
    for split in SPLITS:
        assert str(tmp_path / "listops-1000" / f"basic_{split}.tsv") in message
    assert "lra_release.gz" in message and "generate=True" in message


def test_users_files_are_read_not_overwritten(tmp_path):
    rows = ["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t9", "( ( ( [SM 5 ) 7 ) ] )\t2"]
    folder = tmp_path / "listops-1000"
    _write_tsv(folder / "basic_train.tsv", rows)
    # Only some of the files, and no manifest: the user's copy, incomplete.
    with pytest.raises(MissingDataError) as error:
        _dm(tmp_path).prepare_data()
    assert "basic_val.tsv" in str(error.value) and "basic_test.tsv" in str(error.value)
    _write_tsv(folder / "basic_val.tsv", rows)
    _write_tsv(folder / "basic_test.tsv", rows)
    dm = _dm(tmp_path, train_size=5)
    dm.prepare_data()
    dm.setup()
    assert not (folder / MANIFEST_NAME).exists()
    assert all(dm.datasets[s].labels == [9, 2] for s in SPLITS)


def test_sizes_must_be_positive(tmp_path):
    for bad in (
        {"train_size": 0},
        {"val_size": -1},
        {"batch_size": 0},
        {"max_len": 0},
        {"generate_train_size": 0},
        {"generate_test_size": -5},
        {"generate_processes": 0},
        {"generate_seed": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            _dm(tmp_path, **bad)


def test_datamodule_round_trip(tmp_path):
    dm = _dm(tmp_path, batch_size=8, train_size=40, val_size=12, test_size=12)
    # What the CLI links into the model exists before any file does.
    assert (dm.vocab_size, dm.num_classes, dm.max_len, dm.pad_id) == (16, 10, 2000, 0)
    assert not (tmp_path / "listops-1000").exists()
    dm.prepare_data()
    manifest = json.loads((tmp_path / "listops-1000" / MANIFEST_NAME).read_text())
    assert manifest["sizes"] == {"train": 40, "val": 12, "test": 12}
    dm.setup("fit")
    assert (len(dm.datasets["train"]), len(dm.datasets["val"])) == (40, 12)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        ids, mask, labels = batch["input_ids"], batch["padding_mask"], batch["labels"]
        assert (ids.dtype, mask.dtype, labels.dtype) == (torch.long, torch.bool, torch.long)
        assert ids.shape == mask.shape and ids.shape[0] == 8 and labels.shape == (8,)
        lengths = mask.sum(1)
        # Padded to the longest sequence of this batch rounded up to a multiple of 64
        # (at most max_len), real tokens first.
        longest = int(lengths.max())
        assert ids.shape[1] == min(-(-longest // 64) * 64, 2000)
        assert torch.equal(mask, torch.arange(ids.shape[1]) < lengths[:, None])
        assert (ids[~mask] == dm.pad_id).all() and (ids[mask] != dm.pad_id).all()
        assert (ids < dm.vocab_size).all() and 500 < lengths.min() and lengths.max() < 2000
        assert 0 <= labels.min() and labels.max() < dm.num_classes


def test_generated_files_are_reused_grown_and_regenerated(tmp_path):
    folder = tmp_path / "listops-1000"
    _dm(tmp_path, train_size=30, val_size=5, test_size=5).prepare_data()
    first = {s: (folder / f"basic_{s}.tsv").read_bytes() for s in SPLITS}
    stamp = (folder / "basic_train.tsv").stat().st_mtime_ns
    # Fewer rows: reused as they are.
    _dm(tmp_path, train_size=10, val_size=5, test_size=5).prepare_data()
    assert (folder / "basic_train.tsv").stat().st_mtime_ns == stamp
    # More rows: regenerated larger, starting with the same rows.
    _dm(tmp_path, train_size=60, val_size=5, test_size=5).prepare_data()
    grown = {s: (folder / f"basic_{s}.tsv").read_bytes() for s in SPLITS}
    assert all(grown[s].startswith(first[s]) for s in SPLITS) and grown != first
    # Another seed: regenerated with the sizes this run needs.
    _dm(tmp_path, train_size=10, val_size=5, test_size=5, generate_seed=1).prepare_data()
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert (manifest["seed"], manifest["sizes"]["train"]) == (1, 10)
    assert not (folder / "basic_train.tsv").read_bytes().startswith(first["train"][:500])


def test_interrupted_generation_keeps_the_previous_files(tmp_path, monkeypatch):
    _dm(tmp_path, train_size=10, val_size=5, test_size=5).prepare_data()
    folder = tmp_path / "listops-1000"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def interrupted(paths, *args, **kwargs):
        for path in paths.values():
            path.write_text("Source\tTarget\r\n( ( ( [MAX 2 ) 9 ) ] )\t9\r\n")
        raise KeyboardInterrupt

    monkeypatch.setattr("macformer_lit.data.listops.write_tsv_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _dm(tmp_path, train_size=20, val_size=5, test_size=5).prepare_data()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_long_sequences_are_truncated_and_counted(tmp_path, caplog):
    dm = _dm(tmp_path, train_size=20, val_size=4, test_size=4, max_len=900)
    with caplog.at_level(logging.WARNING, logger="macformer_lit.data.listops"):
        dm.setup("fit")
    full = read_tsv(tmp_path / "listops-1000" / "basic_train.tsv", dm.tokenizer)[0]
    too_long = sum(len(s) > 900 for s in full)
    assert 0 < too_long < 20  # the median length is about 950
    assert f"truncated {too_long} of 20 sequences" in caplog.text
    assert max(len(s) for s in dm.datasets["train"].sequences) == 900


def test_skyformer_datamodule(tmp_path):
    dm = _dm(tmp_path, tokenizer="skyformer", train_size=8, val_size=4, test_size=4)
    assert dm.vocab_size == 15
    dm.setup("fit")
    official = read_tsv(tmp_path / "listops-1000" / "basic_train.tsv", ListOpsTokenizer("official"))
    end = ListOpsTokenizer("official").vocab.index("]")
    dropped = [len(o) - (o == end).sum() for o in official[0]]
    assert [len(s) for s in dm.datasets["train"].sequences] == dropped


def test_pad_to_multiple_of_one_pads_to_the_longest(tmp_path):
    dm = _dm(tmp_path, batch_size=8, train_size=16, val_size=4, test_size=4, pad_to_multiple_of=1)
    dm.setup("fit")
    for batch in dm.train_dataloader():
        assert batch["input_ids"].shape[1] == batch["padding_mask"].sum(1).max()


def test_bucketed_batches_hold_neighbouring_lengths(tmp_path):
    dm = _dm(tmp_path, batch_size=8, train_size=96, val_size=4, test_size=4, bucket_by_length=True)
    dm.setup("fit")
    all_lengths = np.array(dm.datasets["train"].lengths())
    seen = 0
    for batch in dm.train_dataloader():
        lengths = batch["padding_mask"].sum(1).numpy()
        seen += len(lengths)
        lo, hi = lengths.min(), lengths.max()
        # The pool covers the whole set, so a batch is a run of the sorted lengths: every
        # sequence strictly between its shortest and longest is in it.
        inside = ((all_lengths > lo) & (all_lengths < hi)).sum()
        assert inside == ((lengths > lo) & (lengths < hi)).sum()
        assert batch["input_ids"].shape[1] == min(-(-int(hi) // 64) * 64, 2000)
    assert seen == 96


def test_length_flags_make_another_task_in_its_own_folder(tmp_path):
    # LRA's --min_length/--max_length flags: trees with min < length < max, generated into
    # listops-<min>-<max>/ so that they never mix with LRA's listops-1000/.
    full = _dm(tmp_path, train_size=8, val_size=4, test_size=4)
    full.prepare_data()
    before = (tmp_path / "listops-1000" / "basic_train.tsv").read_bytes()
    short = _dm(
        tmp_path,
        train_size=64,
        val_size=4,
        test_size=4,
        generate_min_length=50,
        generate_max_length=300,
        max_len=300,
    )
    assert short.directory == tmp_path / "listops-50-300"
    short.prepare_data()
    short.setup("fit")
    lengths = np.array(short.datasets["train"].lengths())
    assert len(lengths) == 64 and lengths.min() > 50 and lengths.max() < 300
    manifest = json.loads((tmp_path / "listops-50-300" / MANIFEST_NAME).read_text())
    assert (manifest["params"]["min_length"], manifest["params"]["max_length"]) == (50, 300)
    assert (tmp_path / "listops-1000" / "basic_train.tsv").read_bytes() == before
    with pytest.raises(ValueError, match="generate_max_length must exceed"):
        _dm(tmp_path, generate_min_length=300, generate_max_length=300)
