"""The command line of the tiny ListOps run the CLI tests start: 16 training, 8 validation
and 8 test trees in batches of 4 (generated once per data folder), on one CPU device."""

from __future__ import annotations

from pathlib import Path


def tiny_listops(
    data_dir: Path, runs_dir: Path, *extra: str, small_model: bool = False
) -> list[str]:
    """``--config lra_listops.yaml`` and the settings above, then ``extra``; with
    ``small_model``, one layer of width 16."""
    model = ["--model.init_args.d_model", "16", "--model.init_args.num_layers", "1"]
    return [
        "--config",
        "lra_listops.yaml",
        "--data.data_dir",
        str(data_dir),
        "--data.train_size",
        "16",
        "--data.val_size",
        "8",
        "--data.test_size",
        "8",
        "--data.batch_size",
        "4",
        *(model if small_model else []),
        "--runs_dir",
        str(runs_dir),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        *extra,
    ]
