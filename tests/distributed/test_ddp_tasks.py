"""``--trainer.devices 2 --trainer.strategy ddp`` for every task (ListOps and the synthetic
translation task are in test_ddp_eval.py): the other four LRA tasks and Multi30K train in
2 gloo processes through the CLI on fixture files in their public formats, and their test
metrics equal those of 1 process on the same checkpoint (the test splits hold odd numbers
of examples, so a padding sampler would score one twice and change the mean loss)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from ddp_probe import ddp, fit_on_two_then_test_on_one, run_cli, stage_metrics

DATA_TESTS = Path(__file__).resolve().parents[1] / "data"


def _writer(module: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_ddp_{module}", DATA_TESTS / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _fixtures(task: str, data: Path) -> list[str]:
    """Write the task's files under ``data``; return its CLI arguments."""
    if task == "text":  # test split: 3 reviews
        _writer("test_text", "write_aclimdb")(data)
        return ["--config", "lra_text.yaml"]
    if task == "retrieval":  # 3 validation and 3 test pairs
        pair = ("1.0", "a", "b", "first doc", "second doc")
        rows = {"train": [pair, pair[:1] + pair[1:3] + ("x", "y")], "eval": [pair] * 3}
        # Three different test pairs (labels, lengths, bytes), so that scoring one twice or
        # dropping one changes the mean loss.
        test = [
            pair,
            ("0.0", "c", "d", "a much longer third document", "x"),
            ("1.0", "e", "f", "zz zz", "quite another text here"),
        ]
        _writer("test_retrieval", "write_tsv")(data, rows={**rows, "test": test})
        return ["--config", "lra_retrieval.yaml"]
    if task == "image":  # 5 x 5 training images, 5 test images
        _writer("test_image", "write_cifar")(data, per_batch=5)
        return ["--config", "lra_image.yaml", "--data.val_holdout", "5"]
    if task == "pathfinder":
        _writer("test_pathfinder", "write_release")(data, n=40)
        return ["--config", "lra_pathfinder.yaml"]
    _writer("test_multi30k", "write_raw")(data, gz=False)  # test split: 3 sentences
    return [
        "--config",
        "multi30k.yaml",
        "--data.tokenizer_vocab_size",
        "300",
        "--model.init_args.num_encoder_layers",
        "1",
        "--model.init_args.num_decoder_layers",
        "1",
        "--model.init_args.num_heads",
        "2",
        "--model.init_args.max_len_b",
        "4",
    ]


# The default run keeps one LRA task on its own data path (CIFAR pickles); all five run
# with ``pytest -m slow`` (the loaders share make_loader, the suite's time is finite).
@pytest.mark.parametrize(
    "task",
    [
        pytest.param("text", marks=pytest.mark.slow),
        pytest.param("retrieval", marks=pytest.mark.slow),
        pytest.param("image", marks=pytest.mark.slow),
        pytest.param("pathfinder", marks=pytest.mark.slow),
        pytest.param("multi30k", marks=pytest.mark.slow),
    ],
)
def test_ddp_task_test_metrics_equal_one_process(task, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    base = [
        *_fixtures(task, data),
        "--data.batch_size",
        "2",
        "--model.init_args.d_model",
        "16",
        "--model.init_args.ffn_dim",
        "16",
        "--model.init_args.warmup_steps",
        "1",
        "--trainer.max_steps",
        "2",
        "--trainer.max_epochs",
        "-1",
        "--trainer.val_check_interval",
        "2",
        "--trainer.check_val_every_n_epoch",
        "null",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
    ]
    fit_dir, one_dir = fit_on_two_then_test_on_one(tmp_path, base, data, "disabled")
    two, one = stage_metrics(fit_dir), stage_metrics(one_dir)
    assert "test/loss" in one and set(two) == set(one)
    for key in one:
        assert math.isclose(float(two[key]), float(one[key]), rel_tol=1e-5), key


def test_ddp_evaluation_split_smaller_than_the_world_gets_a_clear_message(tmp_path):
    data = tmp_path / "data"
    _writer("test_retrieval", "write_tsv")(data)  # one validation pair
    proc = run_cli(
        ["fit", "--config", "lra_retrieval.yaml", *ddp(2), "--data.data_dir", str(data)]
        + ["--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]
        + ["--model.init_args.d_model", "16", "--trainer.max_steps", "1"],
        cwd=tmp_path,
        expect_ok=False,
    )
    assert proc.returncode == 2
    assert (
        "macformer_lit: error: an evaluation split of 1 example(s) cannot be shared by 2 "
        "processes: each needs at least one; run it on at most 1 device(s)" in proc.stderr
    )
