"""``--ckpt_path`` through the real CLI: a checkpoint never overrides the command line,
every load is ``weights_only=True``, ``last`` / ``best`` resolve for every subcommand,
evaluation refuses to run without a checkpoint, and a bad path gets one line before
anything is built or written."""

import fractions
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import tiny_listops

from macformer_lit.checkpoints import conflicts, full_attention_spec
from macformer_lit.cli import main

QUIET = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]


def tiny(root: Path, *extra: str) -> list[str]:
    return tiny_listops(root / "data", root / "runs", "--experiment", "a", *QUIET, *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four steps with a validation at the last (best and last checkpoints), then the
    test after fit; every torch.load the run makes is recorded."""
    root = tmp_path_factory.mktemp("ckpt")
    loads = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "load", recording_load)
        main(["fit", *tiny(root, "--trainer.max_steps", "4", "--trainer.val_check_interval", "4")])
    run = root / "runs/a/version_0"
    return root, run, loads


def versions(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "runs/a").iterdir())


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    return capsys.readouterr().err.strip()


def test_every_load_of_a_fit_and_its_test_is_weights_only(trained):
    root, run, loads = trained
    assert (run / "checkpoints/last.ckpt").is_file()
    assert len(list((run / "checkpoints").glob("best-step*.ckpt"))) == 1
    # The test after fit loads the best checkpoint: at least that one load happened.
    assert loads, "the test after fit loaded no checkpoint"
    assert all(w is True for w in loads), loads


def test_checkpoint_of_another_backend_is_refused_naming_both(trained, capsys):
    root, run, _ = trained
    before = versions(root)
    err = refused(
        capsys,
        ["test", *tiny(root, "--config", "attention/rmfa_exp.yaml", "--ckpt_path", "last")],
    )
    assert "this checkpoint does not fit the model of this run" in err
    assert "attention: checkpoint has {name: softmax, dropout: 0.0}, this run {name: rmfa" in err
    assert str(run / "config.yaml") in err
    assert len(err.splitlines()) == 1
    assert versions(root) == before


def test_fit_from_a_checkpoint_refuses_another_backend_and_learning_rate(trained, capsys):
    root, run, _ = trained
    before = versions(root)
    ckpt = str(run / "checkpoints/last.ckpt")
    # (max_steps 5: were the guard broken, the resumed fit would stop after one step.)
    steps = ("--trainer.max_steps", "5")
    err = refused(
        capsys, ["fit", *tiny(root, *steps, "--model.init_args.lr", "0.01", "--ckpt_path", ckpt)]
    )
    assert "lr: checkpoint has 0.0001, this run 0.01" in err
    assert "optimiser and learning-rate schedule" in err
    err = refused(
        capsys,
        ["fit", *tiny(root, *steps, "--model.init_args.num_layers", "1", "--ckpt_path", "last")],
    )
    assert "num_layers: checkpoint has 2, this run 1" in err
    assert versions(root) == before


def test_data_settings_that_change_the_vocabulary_are_refused_before_any_folder(trained, capsys):
    root, _, _ = trained
    before = versions(root)
    # The skyformer tokeniser has 15 ids, the checkpoint's vocabulary 16: known only once
    # the DataModule exists, still refused before the Trainer (and its loggers) are built.
    err = refused(
        capsys, ["test", *tiny(root, "--data.tokenizer", "skyformer", "--ckpt_path", "last")]
    )
    assert "vocab_size: checkpoint has 16, this run 15" in err
    assert "the data side differs" in err
    assert versions(root) == before


def test_command_line_wins_and_config_yaml_says_what_ran(trained, capsys):
    """A setting that does not change the weights (dropout) is the command line's, and the
    run's config.yaml records it; LightningCLI's default would take the checkpoint's 0.1."""
    root, run, _ = trained
    main(["test", *tiny(root, "--model.init_args.dropout", "0.25", "--ckpt_path", "best")])
    out = capsys.readouterr().out
    new = root / "runs/a" / versions(root)[-1]
    assert f"Run folder: {new}" in out
    config = yaml.safe_load((new / "config.yaml").read_text())
    assert config["model"]["init_args"]["dropout"] == 0.25
    # `best` resolved to the fit's best checkpoint, and the config names that file.
    (best,) = (run / "checkpoints").glob("best-step*.ckpt")
    assert config["ckpt_path"] == str(best)


@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_evaluation_without_a_checkpoint_is_refused(trained, capsys, subcommand):
    root, _, _ = trained
    before = versions(root)
    err = refused(capsys, [subcommand, *tiny(root)])
    assert err == (
        f"macformer_lit: error: {subcommand} needs a trained model: name its checkpoint with "
        f"--ckpt_path PATH (a .ckpt file), or --ckpt_path last / best for the newest run of "
        f"experiment 'a' under {root / 'runs'}"
    )
    assert versions(root) == before


@pytest.mark.parametrize("which", ["last", "best"])
def test_last_and_best_with_no_run_name_the_folder(trained, capsys, which):
    root, _, _ = trained
    err = refused(capsys, ["test", *tiny(root, "--ckpt_path", which), "--experiment", "none"])
    name = "last.ckpt" if which == "last" else "best-*.ckpt"
    assert f"--ckpt_path {which}: no version_<n>/checkpoints/{name} under {root / 'runs/none'}" in (
        err
    )
    assert not (root / "runs/none").exists()


def test_fit_best_is_refused(trained, capsys):
    root, _, _ = trained
    err = refused(capsys, ["fit", *tiny(root, "--trainer.max_steps", "5", "--ckpt_path", "best")])
    assert "fit resumes a run from its last.ckpt; use --ckpt_path last" in err


def _bad_files(folder: Path, ckpt: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, the message's distinctive part)."""
    data = ckpt.read_bytes()
    (folder / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    (folder / "notes.ckpt").write_text("learning rate 1e-4, 2 layers\n")
    (folder / "empty.ckpt").write_bytes(b"")
    with zipfile.ZipFile(folder / "archive.ckpt", "w") as z:
        z.writestr("a.txt", "not a checkpoint")
    torch.save(torch.zeros(3), folder / "tensor.ckpt")
    (folder / "dir.ckpt").mkdir()
    return {
        "missing": (folder / "nope.ckpt", "no such file"),
        "folder": (folder / "dir.ckpt", "is a folder, not a checkpoint file"),
        "truncated": (folder / "truncated.ckpt", "is truncated or damaged (its end is missing)"),
        "text": (folder / "notes.ckpt", "is not a torch checkpoint"),
        "empty": (folder / "empty.ckpt", "is an empty file"),
        "zip": (folder / "archive.ckpt", "is a zip archive but not a torch checkpoint"),
        "tensor": (folder / "tensor.ckpt", "is a torch file but not a Lightning checkpoint"),
    }


@pytest.mark.parametrize(
    "kind", ["missing", "folder", "truncated", "text", "empty", "zip", "tensor"]
)
@pytest.mark.parametrize("subcommand", ["test", "fit"])
def test_a_path_that_is_no_checkpoint_gets_one_line(trained, tmp_path, capsys, kind, subcommand):
    root, run, _ = trained
    path, expected = _bad_files(tmp_path, run / "checkpoints/last.ckpt")[kind]
    before = versions(root)
    err = refused(
        capsys, [subcommand, *tiny(root, "--trainer.max_steps", "5", "--ckpt_path", str(path))]
    )
    assert err.startswith(f"macformer_lit: error: --ckpt_path {path}"), err
    assert expected in err
    assert len(err.splitlines()) == 1
    # Lifting weights_only cannot help a file that is no torch checkpoint.
    assert "weights_only" not in err
    assert versions(root) == before


def test_a_checkpoint_holding_objects_suggests_weights_only_false(trained, tmp_path, capsys):
    root, run, _ = trained
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    ckpt["extra"] = fractions.Fraction(1, 3)
    path = tmp_path / "objects.ckpt"
    torch.save(ckpt, path)
    err = refused(capsys, ["test", *tiny(root, "--ckpt_path", str(path))])
    assert "holds a Python object (fractions.Fraction)" in err
    assert "if you trust this file, --weights_only false loads it" in err
    # ... and it does.
    main(["test", *tiny(root, "--ckpt_path", str(path), "--weights_only", "false")])
    assert "test/acc = " in capsys.readouterr().out


def test_equivalent_attention_specs_match_and_differences_are_named():
    assert full_attention_spec({"name": "softmax"}) == full_attention_spec(
        {"name": "softmax", "dropout": 0.0}
    )
    assert conflicts(
        {"attention": {"name": "rmfa", "pre_sbn": True, "num_features": 64}},
        {"attention": {"name": "rmfa", "pre_sbn": True}},
        subcommand="test",
    ) == ["attention.num_features: checkpoint has 64, this run 128"]
    # A decoder role left at None means "as attention", on either side.
    assert conflicts(
        {"attention": {"name": "favor"}, "cross_attention": None},
        {"attention": {"name": "softmax"}, "cross_attention": {"name": "favor"}},
        subcommand="test",
    ) == ["attention: checkpoint has {name: favor}, this run {name: softmax}"]
    # The learning rate matters only to a fit, which would resume the saved optimiser.
    assert conflicts({"lr": 1e-4}, {"lr": 1e-3}, subcommand="test") == []
    assert conflicts({"lr": 1e-4}, {"lr": 1e-3}, subcommand="fit") == [
        "lr: checkpoint has 0.0001, this run 0.001"
    ]
