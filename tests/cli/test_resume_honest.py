"""A resume continues one training: ``fit --ckpt_path`` that would change what is trained
is refused in one line naming each key, old and new, before anything is written; settings
that may change are recorded as a dated change in ``provenance.yaml``; the first
``config.yaml`` is never rewritten; a ``max_steps`` the checkpoint has reached is refused."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import tiny_listops

from macformer_lit import provenance
from macformer_lit.checkpoints import resume_changes
from macformer_lit.cli import main

QUIET = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]


def tiny(root: Path, *extra: str) -> list[str]:
    own = ["--trainer.val_check_interval", "4", "--experiment", "a", "--test_after_fit", "false"]
    return ["fit", *tiny_listops(root.parent / "data", root / "runs", *own, *QUIET, *extra)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four steps of batch 4; last.ckpt at step 4."""
    root = tmp_path_factory.mktemp("resume") / "first"
    main(tiny(root, "--trainer.max_steps", "4"))
    return root, root / "runs/a/version_0"


def snapshot(run: Path) -> dict[str, bytes]:
    return {p: (run / p).read_bytes() for p in ("config.yaml", provenance.RECORD)}


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--data.batch_size", "8"], "data.init_args.batch_size: checkpoint has 4, this run 8"),
        (["--data.train_size", "32"], "data.init_args.train_size: checkpoint has 16, this run 32"),
        (["--seed_everything", "7"], "seed_everything: checkpoint has 42, this run 7"),
        (["--trainer.precision", "bf16-mixed"], "trainer.precision: checkpoint has null, this run"),
        (
            ["--trainer.accumulate_grad_batches", "2"],
            "trainer.accumulate_grad_batches: checkpoint has 1, this run 2",
        ),
        (["--model.init_args.dropout", "0.3"], "model.init_args.dropout: checkpoint has 0.1"),
        (
            ["--callbacks.redraw.policy", "steps"],
            "redraw.policy: checkpoint has never, this run steps",
        ),
        (["--dropout_masks", "torch"], "dropout_masks: checkpoint has fast, this run torch"),
    ],
)
@pytest.mark.parametrize("ckpt", ["last", "path"])
def test_a_resume_that_changes_what_is_trained_is_refused(trained, capsys, extra, named, ckpt):
    root, run = trained
    before, versions = snapshot(run), sorted((root / "runs/a").iterdir())
    path = "last" if ckpt == "last" else str(run / "checkpoints/last.ckpt")
    err = refused(capsys, tiny(root, "--trainer.max_steps", "6", *extra, "--ckpt_path", path))
    assert len(err.splitlines()) == 1, err
    assert err.startswith("macformer_lit: error: this resume would change what is trained"), err
    assert named in err
    assert "leave out --ckpt_path to start a new run with these settings" in err
    # Nothing written: the run's files as they were, no new version folder.
    assert snapshot(run) == before
    assert sorted((root / "runs/a").iterdir()) == versions


@pytest.mark.parametrize("steps", ["2", "4"])
def test_max_steps_the_checkpoint_has_reached_is_refused(trained, capsys, steps):
    root, run = trained
    before = snapshot(run)
    err = refused(capsys, tiny(root, "--trainer.max_steps", steps, "--ckpt_path", "last"))
    assert err == (
        f"macformer_lit: error: --trainer.max_steps {steps}: the checkpoint "
        f"{run / 'checkpoints/last.ckpt'} is at step 4 already, so this fit would train "
        f"nothing; to train on, pass --trainer.max_steps above 4; to score it, run test with "
        f"--ckpt_path {run / 'checkpoints/last.ckpt'}"
    )
    assert snapshot(run) == before


def test_a_finished_fit_whose_test_never_completed_runs_only_that_test(trained, tmp_path, capsys):
    """Training at its max_steps with no test result (the test after fit was killed or
    failed): the same fit command runs only the test, saying so, and a sweep's retry of the
    point can finish it; once the test is logged, the same command is refused."""
    first, _ = trained
    root = tmp_path / "copy"
    shutil.copytree(first / "runs", root / "runs")
    shutil.copytree(first.parent / "data", tmp_path / "data")
    run = root / "runs/a/version_0"
    argv = tiny(root, "--trainer.max_steps", "4", "--ckpt_path", "last", "--test_after_fit", "true")
    main(argv)
    out = capsys.readouterr().out
    assert "only that test runs" in out
    text = (run / "metrics.csv").read_text()
    assert "test/acc" in text.splitlines()[0]
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=False)["global_step"] == 4
    err = refused(capsys, argv)
    assert "is at step 4 already, so this fit would train nothing" in err


def test_allowed_changes_are_recorded_and_config_yaml_is_kept(trained, tmp_path):
    first, _ = trained
    root = tmp_path / "copy"
    shutil.copytree(first / "runs", root / "runs")
    shutil.copytree(first.parent / "data", tmp_path / "data")
    run = root / "runs/a/version_0"
    config = (run / "config.yaml").read_bytes()
    main(
        tiny(
            root,
            *("--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1"),
            *("--trainer.val_check_interval", "2", "--ckpt_path", "last"),
        )
    )
    assert not (root / "runs/a/version_1").exists()
    assert (run / "config.yaml").read_bytes() == config
    first_entry, resumed = provenance.read(run)
    assert "changes" not in first_entry and "checkpoint" not in first_entry
    assert resumed["checkpoint"] == {"path": str(run / "checkpoints/last.ckpt"), "step": 4}
    assert resumed["when"] >= first_entry["when"]
    # The data moved with the copy: where it lives may change too.
    assert {c["key"]: (c["old"], c["new"]) for c in resumed["changes"]} == {
        "data.init_args.data_dir": (str(first.parent / "data"), str(tmp_path / "data")),
        "trainer.max_steps": (4, 6),
        "trainer.log_every_n_steps": (50, 1),
        "trainer.val_check_interval": (4, 2),
    }
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    # The checkpoint records the config it trained on with; readers apply the changes.
    assert ckpt[provenance.CHECKPOINT_KEY]["config"]["trainer"]["max_steps"] == 6
    effective = provenance.effective_config(yaml.safe_load(config), provenance.read(run))
    assert effective["trainer"]["max_steps"] == 6


def test_a_checkpoint_trained_in_another_precision_is_refused(trained, tmp_path, capsys):
    """The same --trainer.precision can run another precision on another machine (16-mixed
    is bf16 on a CPU, fp16 on a GPU): what the checkpoint recorded is compared with what
    this Trainer would run."""
    root, run = trained
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    ckpt[provenance.CHECKPOINT_KEY]["precision"] = "bf16-mixed"
    path = tmp_path / "bf16.ckpt"
    torch.save(ckpt, path)
    versions = sorted((root / "runs/a").iterdir())
    err = refused(capsys, tiny(root, "--trainer.max_steps", "6", "--ckpt_path", str(path)))
    assert err.endswith(
        "precision: checkpoint trained in bf16-mixed, this run would train in 32-true on CPU. "
        "A resume continues the same training: resume where --trainer.precision runs "
        "bf16-mixed, or leave out --ckpt_path to start a new run with these settings"
    ), err
    assert len(err.splitlines()) == 1
    # The new run folder the path resume claimed is gone again.
    assert sorted((root / "runs/a").iterdir()) == versions


def test_which_keys_may_change():
    saved = {
        "seed_everything": 1,
        "ckpt_path": None,
        "trainer": {
            "max_steps": 4,
            "devices": 1,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}],
        },
        "callbacks": {"rng_states": True, "lr_monitor": True},
        "old_option": 1,
    }
    run = {
        "seed_everything": 1,
        "ckpt_path": "last",
        "trainer": {"max_steps": 8, "devices": 2, "callbacks": None},
        "callbacks": {"rng_states": False, "lr_monitor": False},
        "new_option": 2,
    }
    refused_keys, allowed = resume_changes(saved, run)
    # An observing callback dropped, devices (an elastic resume), a later max_steps, the
    # learning-rate monitor: recorded. Restoring the RNG states changes what is trained.
    assert [c["key"] for c in allowed] == [
        "callbacks.lr_monitor",
        "trainer.callbacks",
        "trainer.devices",
        "trainer.max_steps",
    ]
    assert refused_keys == ["callbacks.rng_states: checkpoint has true, this run false"]
    # A callback that acts (early stopping ends the training) is refused.
    stopping = {"class_path": "lightning.pytorch.callbacks.EarlyStopping"}
    refused_keys, _ = resume_changes(saved, {**run, "trainer": {"callbacks": [stopping]}})
    assert [p.split(":")[0] for p in refused_keys] == [
        "callbacks.rng_states",
        "trainer.callbacks",
    ]


def test_the_only_test_left_note_is_printed_by_rank_zero_only(tmp_path, capsys, monkeypatch):
    """DDP's other ranks parse the same command and check the same checkpoint: one note."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from macformer_lit.checkpoints import check_fits

    run = tmp_path / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,train/loss\n3,1.0\n")  # no test result yet
    checkpoint = {"global_step": 4, "epoch": 0, "hyper_parameters": {}}
    config = {"trainer": {"max_steps": 4}, "test_after_fit": True}
    for rank, printed in ((0, True), (1, False)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        check_fits(
            run / "checkpoints/last.ckpt",
            checkpoint,
            {},
            subcommand="fit",
            saved_config=config,
            run_config=config,
        )
        assert ("only that test runs" in capsys.readouterr().out) is printed
