"""Mistakes and faults through the real CLI: one line naming the problem and the fix, exit
code 2, and nothing written (no run folder, no data) or lost.

Each class of mistake is tried with more than one instance (other options, other files,
other subcommands), as a user would meet them.
"""

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import tiny_listops

from macformer_lit.cli import SUBCOMMANDS, config_stem, main, resume_command
from macformer_lit.preflight import short_parse_error
from macformer_lit.runs import RunFolder

QUIET = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]


def tiny(root: Path, *extra: str, quiet: bool = True) -> list[str]:
    lengths = ["--data.generate_min_length", "50", "--data.generate_max_length", "300"]
    rest = [*(QUIET if quiet else ["--trainer.enable_progress_bar", "false"]), *extra]
    return tiny_listops(root / "data", root / "runs", *lengths, *rest, small_model=True)


def refused(capsys, argv: list[str], root: Path) -> str:
    """The one stderr line of a refused command; nothing was created under ``root``."""
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("macformer_lit: error: "), lines
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    return lines[0]


# ---- config files ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("model:\n  init_args:\n\td_model: 32\n", "line 3: indented with a tab character"),
        ("trainer:\n  max_steps: 5\n   bad: [1,\n", "line 3, column"),
        ("model: [1,\n", "line 2, column 1: not valid YAML"),
        ("", "is empty: a config is a mapping of settings"),
        ("# only a comment\n", "is empty: a config is a mapping of settings"),
        ("- a\n- b\n", "holds a list at its top level: a config is a mapping"),
        ("just words\n", "holds a str at its top level: a config is a mapping"),
    ],
)
@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_config_file_mistakes_name_the_file_and_line(tmp_path, capsys, text, expected, subcommand):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = refused(capsys, [subcommand, *tiny(tmp_path, "--config", str(bad))], tmp_path)
    assert f"config {bad}" in line and expected in line, line


# ---- wrong types and choices -----------------------------------------------------------
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--data.tokenizer", "foo"], "data.tokenizer: expected one of 'official', 'skyformer'"),
        (["--model.init_args.num_layers", "two"], "model.num_layers: expected an integer"),
        (["--trainer.max_steps", "ten"], "trainer.max_steps: expected an integer"),
        (["--seed_everything", "abc"], "seed_everything: expected true or false or an integer"),
        (["--trainer.max_stepz", "3"], "unrecognized arguments: --trainer.max_stepz 3"),
        (["--dropout_masks", "slow"], "expected one of 'fast', 'torch'"),
        (["--model.init_args.pooling", "max"], "model.pooling: expected one of 'mean'"),
    ],
)
def test_a_wrong_type_or_choice_is_one_line_with_the_valid_values(
    tmp_path, capsys, extra, expected
):
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert expected in line, line
    assert "(options: macformer_lit fit --help)" in line
    assert "Union" not in line and "NoneType" not in line


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--callbacks.nan_guard.action", "sometimes"],
            "callbacks.nan_guard.action: expected one of 'stop', 'skip'; got 'sometimes'",
        ),
        (
            ["--callbacks.telemetry", "false", "--callbacks.unknown", "true"],
            "unrecognized arguments: --callbacks.unknown true",
        ),
        (
            ["--callbacks.telemetry", "maybe"],
            "callbacks.telemetry: expected a mapping or a class path or true or false",
        ),
        (
            ["--callbacks.best_checkpoint.save_top_k", "-2"],
            "--callbacks.best_checkpoint: save_top_k must be >= -1",
        ),
        (
            ["--callbacks.redraw.every_n_steps", "0"],
            "--callbacks.redraw: every_n_steps must be >= 1; got 0",
        ),
        (
            ["--callbacks.nan_guard.min_loss_scale", "0"],
            "--callbacks.nan_guard: NaNGuard min_loss_scale must be > 0",
        ),
        (
            ["--callbacks.memory.every_n_steps", "-1"],
            "--callbacks.memory: ReleaseHostMemory every_n_steps must be an integer >= 0",
        ),
        # Old options: a key that cannot move, and a bad value at its new place.
        (
            ["--callbacks.telemetry", "false", "--run_callbacks.foo", "1"],
            "unrecognized arguments: --run_callbacks.foo 1",
        ),
        (["--nan_guard.foo", "1"], "callbacks.nan_guard: Option 'foo' is not accepted"),
        (
            ["--run_callbacks.save_top_k", "-3"],
            "--callbacks.best_checkpoint: save_top_k must be >= -1",
        ),
    ],
)
def test_a_bad_callbacks_entry_is_one_line_before_anything_is_built(
    tmp_path, capsys, extra, expected
):
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert expected in line, line
    assert "Union" not in line and "NoneType" not in line
    assert not (tmp_path / "data").exists()  # the DataModule never ran


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "callbacks:\n  telemetry: false\n  unknown: true\n",
            "does not accept option 'callbacks.unknown'",
        ),
        ("callbacks:\n  redraw:\n    policy: sometimes\n", "callbacks.redraw.policy: expected"),
        ("run_callbacks:\n  lr_logging_interval: hourly\n", "callbacks.lr_monitor.logging_in"),
    ],
)
def test_a_bad_callbacks_entry_in_a_config_file_is_one_line(tmp_path, capsys, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    line = refused(capsys, ["fit", *tiny(tmp_path, "--config", str(bad))], tmp_path)
    assert expected in line, line


def test_short_parse_error_keeps_the_innermost_failure():
    message = (
        'Parser key "model":\n'
        "  Does not validate against any of the Union subtypes\n"
        "  Errors:\n"
        "    - Problem with given class_path 'macformer_lit.tasks.LitClassifier':\n"
        '        Parser key "attention":\n'
        "          Does not validate against any of the Union subtypes\n"
        "          Errors:\n"
        "            - Expected a <class 'dict'>\n"
        "            - Expected a <class 'NoneType'>\n"
        "          Given value type: <class 'int'>\n"
        "          Given value: 3\n"
        "    - Expected a <class 'NoneType'>\n"
    )
    assert short_parse_error(message) == "model.attention: expected a mapping; got '3'"
    union = (
        'Parser key "seed_everything":\n'
        "  Does not validate against any of the Union subtypes\n"
        "  Errors:\n"
        "    - Expected a <class 'bool'>\n"
        "    - Expected a <class 'int'>\n"
        "  Given value: abc\n"
    )
    assert short_parse_error(union) == (
        "seed_everything: expected true or false or an integer; got 'abc'"
    )
    other = (
        'Parser key "data":\n'
        "  Errors:\n"
        "    - Problem with given class_path 'lightning.LightningDataModule':\n"
        "        Option 'data_dir' is not accepted\n"
        "    - Expected a <class 'NoneType'>\n"
    )
    assert short_parse_error(other) == "data: Option 'data_dir' is not accepted"
    assert short_parse_error("Unrecognized arguments: --foo 1") == (
        "Unrecognized arguments: --foo 1"
    )


def test_a_bare_backend_name_means_that_backend(tmp_path, capsys):
    cfg = tmp_path / "bare.yaml"
    cfg.write_text("model:\n  init_args:\n    attention: linear\n")
    main(["fit", *tiny(tmp_path, "--config", str(cfg), "--trainer.max_steps", "1",
                       "--test_after_fit", "false", "--experiment", "bare")])  # fmt: skip
    run = tmp_path / "runs/bare/version_0"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["init_args"]["attention"] == {"name": "linear"}
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["hyper_parameters"]["attention"] == {"name": "linear"}


# ---- values Lightning or torch would reject later ---------------------------------------
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--trainer.max_steps", "-5"], "--trainer.max_steps -5: must be at least -1"),
        (["--trainer.max_epochs", "-2"], "--trainer.max_epochs -2: must be at least -1"),
        (["--trainer.log_every_n_steps", "0"], "--trainer.log_every_n_steps 0: must be at least 1"),
        (
            ["--trainer.accumulate_grad_batches", "0"],
            "accumulate_grad_batches 0: must be at least 1",
        ),
        (["--trainer.gradient_clip_val", "-1.0"], "gradient_clip_val -1.0: must be at least 0"),
        (["--trainer.val_check_interval", "0"], "val_check_interval 0: must be a fraction"),
        (["--trainer.limit_val_batches", "2.5"], "a float is a fraction of an epoch"),
    ],
)
def test_trainer_values_are_refused_before_anything_is_built(tmp_path, capsys, extra, expected):
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert line.startswith("macformer_lit: error: invalid trainer settings: "), line
    assert expected in line, line
    assert not (tmp_path / "data").exists()  # the DataModule never ran


@pytest.mark.parametrize(
    "extra, expected",
    [(["--trainer.strategy", "dddp"], "dddp"), (["--trainer.devices", "-5"], "devices")],
)
def test_lightning_checks_while_building_the_trainer_are_one_line(
    tmp_path, capsys, extra, expected
):
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert line.startswith("macformer_lit: error: invalid trainer settings: "), line
    assert expected in line


def test_max_steps_zero_warns_that_nothing_is_trained(tmp_path, capfd):
    main(["fit", *tiny(tmp_path, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    assert "warning: --trainer.max_steps 0: nothing will be trained" in capfd.readouterr().err


@pytest.mark.parametrize(
    "extra, source",
    [
        (["--data.max_len", "100000000000"], "--data.max_len 100000000000"),
        (["--data.max_len", "0"], "--data.max_len 0: must be at least 1"),
    ],
)
def test_a_position_table_that_cannot_be_allocated_is_refused(tmp_path, capsys, extra, source):
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert source in line, line


# ---- paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_folders_that_are_files_are_named_with_the_option(tmp_path, capsys, subcommand):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for option, value, expected in [
        ("--data.data_dir", str(afile), f"--data.data_dir {afile}: is a file, not a folder"),
        ("--runs_dir", str(afile), f"--runs_dir {afile}: is a file, not a folder"),
        ("--runs_dir", str(afile / "sub"), f"{afile} is a file, not a folder: change --runs_dir"),
        ("--data.data_dir", str(afile / "d"), f"{afile} is a file, not a folder: change"),
    ]:
        line = refused(capsys, [subcommand, *tiny(tmp_path), option, value], tmp_path)
        assert expected in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder")
def test_an_unwritable_runs_dir_is_named(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    line = refused(capsys, ["fit", *tiny(tmp_path), "--runs_dir", str(ro)], tmp_path)
    assert "the folder is not writable: change --runs_dir" in line


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".", " ", "a\\b"])
def test_experiment_names_are_one_folder(tmp_path, capsys, name):
    line = refused(capsys, ["fit", *tiny(tmp_path), "--experiment", name], tmp_path)
    assert f"--experiment {name!r}: an experiment is one folder name under --runs_dir" in line


def test_an_experiment_named_from_config_paths_uses_file_names(tmp_path):
    copy = tmp_path / "abs/dir/configs/my_listops.yaml"
    copy.parent.mkdir(parents=True)
    copy.write_text("seed_everything: 3\n")
    assert config_stem(str(copy)) == "my_listops"
    from macformer_lit.cli import CONFIG_DIR

    assert config_stem(str(CONFIG_DIR / "attention/rmfa_exp.yaml")) == "attention-rmfa_exp"
    assert config_stem(str(CONFIG_DIR / "lra_listops.yaml")) == "lra_listops"


# ---- a failed start leaves nothing behind ------------------------------------------------
def test_a_failed_start_with_wandb_offline_leaves_no_folder_and_ends_on_the_error(tmp_path):
    """Text data missing: the error comes from the DataModule inside ``fit``, after the
    run folder was claimed and the offline W&B run started."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_API_KEY": ""}
    env.pop("WANDB_API_KEY")
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", "lra_text.yaml",
         "--data.data_dir", str(tmp_path / "nodata"), "--runs_dir", str(tmp_path / "runs"),
         "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    # The error (what is missing and how to get it) is the last thing printed.
    error = proc.stderr[proc.stderr.rindex("macformer_lit: error: ") :]
    assert "nodata" in error and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "wandb:" not in error and "wandb sync" not in proc.stdout + proc.stderr
    assert not (tmp_path / "runs").exists(), sorted(tmp_path.rglob("*"))


def _claim(args):
    exp_dir, barrier = args
    barrier.wait()
    return str(RunFolder(Path(exp_dir)).claim())


def test_run_folders_are_claimed_atomically(tmp_path):
    with multiprocessing.Manager() as manager:
        barrier = manager.Barrier(4)
        with multiprocessing.get_context("fork").Pool(4) as pool:
            got = pool.map(_claim, [(str(tmp_path / "exp"), barrier)] * 4)
    assert sorted(Path(g).name for g in got) == [f"version_{i}" for i in range(4)]


@pytest.mark.slow
def test_two_fits_started_at_once_get_their_own_folders(tmp_path):
    """The user's case; whether the two processes race for the same number depends on
    timing (the barrier test above forces the race)."""
    main(["fit", *tiny(tmp_path, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "macformer_lit", "fit",
            *tiny(tmp_path, "--trainer.max_steps", "2", "--test_after_fit", "false",
                  "--experiment", "dup")]  # fmt: skip
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    runs = sorted((tmp_path / "runs/dup").iterdir())
    assert [r.name for r in runs] == ["version_0", "version_1"]
    for run in runs:
        # Each folder holds one whole run: its config, its 2 steps, its own metrics rows
        # (a shared folder held one metrics.csv row and mixed checkpoints).
        assert (run / "config.yaml").is_file()
        assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2
    rows = [(r / "metrics.csv").read_text() for r in runs]
    assert rows[0].count("\n") == rows[1].count("\n") >= 2


# ---- Ctrl-C ----------------------------------------------------------------------------
@pytest.mark.slow  # test_interruptions.py's and test_preemption.py's signal cases run by default
def test_ctrl_c_saves_last_checkpoint_and_prints_the_resume_command(tmp_path):
    main(["fit", *tiny(tmp_path, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = tiny(tmp_path, "--experiment", "int", "--trainer.val_check_interval", "2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "macformer_lit", "fit", *argv, "--trainer.max_steps", "100000"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    last = tmp_path / "runs/int/version_0/checkpoints/last.ckpt"
    deadline = time.time() + 240
    while not last.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert last.exists(), proc.communicate()[0][-3000:]
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    saved = torch.load(last, weights_only=True, map_location="cpu")["global_step"]
    expected = resume_command(["fit", *argv, "--trainer.max_steps", "100000"])
    # A stop inside a validation says so: the resume runs that validation again.
    during = " (in a validation, which the resume runs again)"
    said = [
        f"Ctrl-C: saved {last} at step {saved}{d}; resume with: {expected}" for d in ("", during)
    ]
    assert any(line in out for line in said), out[-3000:]
    assert "Traceback" not in out and "was not set, defaulting" not in out, out[-3000:]
    assert expected.endswith("--ckpt_path last")

    cmd = expected.split()[3:-2]  # the resume command, with a step budget to finish
    resumed = subprocess.run(
        [sys.executable, "-m", "macformer_lit", *cmd, "--trainer.max_steps", str(saved + 2),
         "--ckpt_path", "last", "--test_after_fit", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == saved + 2


def test_resume_command_replaces_any_checkpoint_argument():
    assert resume_command(["fit", "--config", "a b.yaml", "--ckpt_path", "x.ckpt"]) == (
        "python -m macformer_lit fit --config 'a b.yaml' --ckpt_path last"
    )
    assert resume_command(["fit", "--ckpt_path=x"]).endswith("fit --ckpt_path last")


# ---- disk full -----------------------------------------------------------------------
def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path):
    """Files are limited to 200 kB: the data and metrics fit, the checkpoint (a 2000 x 16
    position table with its Adam moments, ~400 kB) does not."""
    main(["fit", *tiny(tmp_path, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit",
         *tiny(tmp_path, "--trainer.max_steps", "2", "--experiment", "full")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    ckpt_dir = tmp_path / "runs/full/version_0/checkpoints"
    assert last.startswith(f"macformer_lit: error: could not write checkpoint {ckpt_dir}/"), last
    assert "free disk space or point --runs_dir at another disk" in last
    assert not [p for p in ckpt_dir.iterdir() if ".tmp-" in p.name]


# ---- --help and unknown subcommands -----------------------------------------------------
def test_help_says_what_the_program_is_and_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--help"])
    assert err.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "random-feature approximation (Macformer's RMFA with ppSBN" in out
    assert "Lightning Trainer command line tool" not in out
    for name in SUBCOMMANDS:
        assert f"{name}:" in out, name


@pytest.mark.parametrize("word", ["frobnicate", "train", "reports"])
def test_an_unknown_subcommand_lists_them_all(capsys, word):
    with pytest.raises(SystemExit) as err:
        main([word, "--config", "lra_listops.yaml"])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"macformer_lit: error: unknown subcommand {word!r}; usage: macformer_lit "
        "{fit,validate,test,predict,report,sweep} ... (macformer_lit --help)"
    )


# ---- a test split without examples -------------------------------------------------------
def test_an_empty_test_split_stops_fit_before_training(tmp_path, capsys):
    main(["fit", *tiny(tmp_path, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    (test_tsv,) = (tmp_path / "data").rglob("basic_test.tsv")
    test_tsv.write_text(test_tsv.read_text().splitlines()[0] + "\n")  # its header only
    for manifest in (tmp_path / "data").rglob("*.json"):
        manifest.unlink()  # a user's own files: read as they are
    before = sorted((tmp_path / "runs").rglob("*"))
    with pytest.raises(SystemExit) as err:
        main(["fit", *tiny(tmp_path, "--trainer.max_steps", "2")])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"macformer_lit: error: {test_tsv}"), lines[-3:]
    assert "the test split holds no examples" in lines[-1]
    assert sorted((tmp_path / "runs").rglob("*")) == before  # no new run folder


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: x\naxes: [\n", "line 3, column 1: not valid YAML"),
        ("name: x\naxes:\n\tseed: [0, 1]\n", "line 3: indented with a tab character"),
        ("", "is empty"),
        ("- a\n", "holds a list at its top level"),
    ],
)
def test_a_bad_sweep_file_is_one_line(tmp_path, capsys, text, expected):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(text)
    with pytest.raises(SystemExit) as err:
        main(["sweep", str(sweep), "--runs_dir", str(tmp_path / "runs")])
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"macformer_lit sweep: error: sweep config {sweep}"), line
    assert expected in line, line
    assert not (tmp_path / "runs").exists()


# ---- attention options that do not fit where they are used -------------------------------
@pytest.mark.parametrize(
    "config, extra, expected",
    [
        # A prefix in a translation model's shared spec reaches its decoder.
        (
            "translation_synthetic.yaml",
            ["--model.init_args.attention", "{name: softmax, prefix: forward}"],
            "put it in encoder_attention",
        ),
        (
            "translation_synthetic.yaml",
            ["--model.init_args.cross_attention", "{name: rmfa, prefix: split}"],
            "not in cross attention",
        ),
        # One value per layer: the list must match the encoder's depth.
        (
            "lra_listops.yaml",
            ["--model.init_args.attention", "{name: softmax, prefix: [forward, none, none]}"],
            "one value per layer",
        ),
        (
            "lra_listops.yaml",
            ["--model.init_args.attention", "{name: uniform, num_features: 64}"],
            "no option(s) num_features",
        ),
        (
            "lra_listops.yaml",
            [
                "--model.init_args.attention",
                "{name: rmfa, kernel: inv, pre_sbn: true, temperature_max: 32.0}",
            ],
            "temperature_max < √head_dim",
        ),
    ],
)
def test_attention_options_that_do_not_fit_are_one_line(tmp_path, capsys, config, extra, expected):
    argv = ["fit", "--config", config, "--runs_dir", str(tmp_path / "runs"),
            "--data.data_dir", str(tmp_path / "data"), *QUIET, *extra]  # fmt: skip
    line = refused(capsys, argv, tmp_path)
    assert expected in line, line
