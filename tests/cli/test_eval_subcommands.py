"""``validate`` and ``predict`` through the real CLI, on a checkpoint a tiny ``fit`` wrote:
validation reproduces the fit's own validation numbers, and ``predict`` writes one row per
test example (in split order, with its label) whose accuracy and loss are the test's."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from macformer_lit.cli import main

QUIET = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]


def tiny(root: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "lra_listops.yaml",
        "--data.data_dir",
        str(root / "data"),
        "--data.train_size",
        "16",
        "--data.val_size",
        "8",
        "--data.test_size",
        "11",
        "--data.batch_size",
        "4",
        "--runs_dir",
        str(root / "runs"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--experiment",
        "e",
        *QUIET,
        *extra,
    ]


def last_value(metrics_csv: Path, key: str) -> float:
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get(key)]
    assert rows, f"no {key} in {metrics_csv}"
    return float(rows[-1][key])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four steps at a learning rate that moves the weights (no warm-up), a validation at
    the last step, then the test of that (best) checkpoint."""
    root = tmp_path_factory.mktemp("eval")
    main(
        [
            "fit",
            *tiny(root, "--trainer.max_steps", "4", "--trainer.val_check_interval", "4"),
            *("--model.init_args.lr", "0.01", "--model.init_args.warmup_steps", "1"),
        ]
    )
    return root, root / "runs/e/version_0"


def test_validate_reproduces_the_fits_validation(trained, capsys):
    root, run = trained
    main(["validate", *tiny(root, "--ckpt_path", "best")])
    out = capsys.readouterr().out
    new = root / "runs/e/version_1"
    assert f"Run folder: {new}" in out
    for key in ("val/loss", "val/acc"):
        assert last_value(new / "metrics.csv", key) == pytest.approx(
            last_value(run / "metrics.csv", key), rel=1e-6, abs=1e-7
        ), key


def test_predict_writes_every_test_example_once_in_split_order(trained, capsys):
    root, run = trained
    main(["predict", *tiny(root, "--ckpt_path", "best")])
    out = capsys.readouterr().out
    new = root / "runs/e/version_2"
    path = new / "predictions.csv"
    assert f"Predictions: {path} (11 examples)" in out
    rows = list(csv.DictReader(path.open()))
    assert [int(r["index"]) for r in rows] == list(range(11))
    # The labels are the test split's, by index (length buckets reorder the batches).
    tsv = root / "data/listops-1000/basic_test.tsv"
    labels = [int(r["Target"]) for r in csv.DictReader(tsv.open(), delimiter="\t")][:11]
    assert [int(r["label"]) for r in rows] == labels
    probs = [[float(r[f"prob_{c}"]) for c in range(10)] for r in rows]
    for r, p in zip(rows, probs):
        assert sum(p) == pytest.approx(1.0, abs=1e-5)
        assert int(r["prediction"]) == max(range(10), key=p.__getitem__)
    # Accuracy and mean cross-entropy of the written rows are the test's of the same
    # checkpoint (probabilities written to 6 significant digits).
    acc = sum(int(r["prediction"]) == y for r, y in zip(rows, labels)) / len(rows)
    loss = -sum(math.log(p[y]) for p, y in zip(probs, labels)) / len(rows)
    assert acc == pytest.approx(last_value(run / "metrics.csv", "test/acc"), abs=1e-9)
    assert loss == pytest.approx(last_value(run / "metrics.csv", "test/loss"), rel=1e-5)


@pytest.mark.slow
def test_predict_under_ddp_writes_one_file_with_every_example_once(trained, tmp_path):
    """Two gloo processes, 11 examples: shares of 6 and 5, gathered into one file equal to
    the one-process file."""
    root, run = trained
    (best,) = (run / "checkpoints").glob("best*.ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "macformer_lit", "predict"]
    args = tiny(root, "--ckpt_path", str(best))
    one = subprocess.run(
        [*cmd, *args, "--runs_dir", str(tmp_path / "one")], env=env, capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr[-2000:]
    ddp = [
        *("--trainer.strategy", "ddp", "--trainer.devices", "2"),
        *("--runs_dir", str(tmp_path / "two")),
    ]
    two = subprocess.run([*cmd, *args, *ddp], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-2000:]
    files = list((tmp_path / "two").rglob("predictions.csv"))
    assert len(files) == 1
    assert two.stdout.count("Predictions: ") == 1
    rows_one = list(csv.DictReader(next((tmp_path / "one").rglob("predictions.csv")).open()))
    rows_two = list(csv.DictReader(files[0].open()))
    assert [r["index"] for r in rows_two] == [str(i) for i in range(11)]
    for a, b in zip(rows_one, rows_two):
        assert a["prediction"] == b["prediction"] and a["label"] == b["label"]
        for c in range(10):
            assert float(a[f"prob_{c}"]) == pytest.approx(float(b[f"prob_{c}"]), rel=1e-5)
