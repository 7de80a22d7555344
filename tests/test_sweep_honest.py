"""A sweep tables a point as done only when its run had the settings the sweep file gives it
now: a point whose args were edited after it finished runs again into a new version (or is
refused with --no_rerun_changed), an unfinished run of other settings is not resumed, shared
settings that do not parse stop the sweep once, and a metrics.csv row that is not whole is
flagged. The runs are stand-ins (``FakeCLI``) that write what the CLI would: the settings
come from the CLI's own parser (``sweep.resolve_settings``), so nothing here trains.
"""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from macformer_lit import sweep

REPO = Path(__file__).resolve().parents[1]
RUNS = ["--wandb_mode", "disabled"]


def write_spec(tmp_path, **changes) -> Path:
    args = {
        "data.init_args.data_dir": str(tmp_path / "data"),
        "data.init_args.train_size": 96,
        "model.init_args.d_model": 32,
        "trainer.max_epochs": 2,
        "trainer.accelerator": "cpu",
    }
    spec = {
        "name": "honest",
        "config": str(REPO / "configs" / "translation_synthetic.yaml"),
        "args": {**args, **changes},
        "axes": {"seed": {"0": {"seed_everything": 0}, "1": {"seed_everything": 1}}},
        "report": {"average_over": ["seed"]},
    }
    path = tmp_path / "honest.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class FakeCLI:
    """Stands in for the CLI subprocess: claims the next version folder, writes the
    config.yaml the command resolves to and a metrics.csv, prints "Run folder:"."""

    def __init__(self):
        self.commands: list[list[str]] = []

    def __call__(self, cmd, stdout, **kwargs):
        self.commands.append(cmd)
        exp = Path(cmd[cmd.index("--runs_dir") + 1]) / cmd[cmd.index("--experiment") + 1]
        last = exp.glob("version_*/checkpoints/last.ckpt")
        if "--ckpt_path" in cmd and (found := max(last, default=None)):
            run = found.parent.parent  # a resume writes into its run's folder
        else:
            run = exp / f"version_{len(list(exp.glob('version_*')))}"
            run.mkdir(parents=True)
            settings = sweep.resolve_settings(cmd)
            (run / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        (run / "metrics.csv").write_text("epoch,step,val/loss\n0,3,2.0\n1,6,1.5\n")
        stdout.write(f"Run folder: {run}\n")
        return subprocess.CompletedProcess(cmd, 0)


@pytest.fixture
def fake(monkeypatch):
    runner = FakeCLI()
    monkeypatch.setattr(sweep.subprocess, "run", runner)
    # The sweep starts each point with _run_child (Popen in its own session); sweep.subprocess
    # is the subprocess module itself, so its Popen is not patched.
    monkeypatch.setattr(
        sweep, "_run_child", lambda cmd, log, env: (runner(cmd, log).returncode, None)
    )
    # The plot is test_sweep.py's; here it only costs time.
    monkeypatch.setattr(sweep, "plot_curves", lambda spec, points, statuses, path: path)
    return runner


def run_sweep(path, tmp_path, *extra) -> int:
    try:
        return sweep.main([str(path), "--runs_dir", str(tmp_path / "runs"), *RUNS, *extra])
    except SystemExit as err:
        return err.code


def table(tmp_path, stem="results") -> dict[str, dict]:
    with open(tmp_path / "runs" / "honest" / f"{stem}.csv", newline="") as f:
        return {r.get("run") or r["seed"]: r for r in csv.DictReader(f)}


def status(tmp_path, point="seed=0") -> dict:
    return json.loads((tmp_path / "runs" / "honest" / point / sweep.STATUS_FILE).read_text())


def test_edited_args_run_the_finished_points_again_into_new_versions(tmp_path, fake, capsys):
    path = write_spec(tmp_path)
    assert run_sweep(path, tmp_path) == 0
    assert len(fake.commands) == 2
    assert run_sweep(path, tmp_path) == 0  # unchanged: both done before
    assert len(fake.commands) == 2
    assert capsys.readouterr().out.count("done before, skipped") == 2

    write_spec(tmp_path, **{"trainer.max_epochs": 3})
    assert run_sweep(path, tmp_path) == 0
    out = capsys.readouterr().out
    assert out.count("settings changed since its run") == 2, out
    assert "trainer.max_epochs: 2 -> 3; running it again into a new version" in out
    assert len(fake.commands) == 4
    assert all("--ckpt_path" not in cmd for cmd in fake.commands[2:])  # a new run
    done = status(tmp_path)
    assert done["run_dir"].endswith("seed=0/version_1")
    assert done["replaces"].endswith("seed=0/version_0")
    assert table(tmp_path)["seed=0"]["run_dir"] == done["run_dir"]


def test_no_rerun_changed_refuses_and_never_tables_the_old_run_as_done(tmp_path, fake, capsys):
    path = write_spec(tmp_path)
    assert run_sweep(path, tmp_path) == 0
    write_spec(tmp_path, **{"model.init_args.d_model": 64})
    assert run_sweep(path, tmp_path, "--no_rerun_changed") == 1
    assert len(fake.commands) == 2  # nothing ran again
    out = capsys.readouterr().out
    assert "model.init_args.d_model: 32 -> 64; not run again (--no_rerun_changed)" in out
    for flags in ([], ["--report_only"]):
        if flags:
            assert run_sweep(path, tmp_path, *flags) == 0
        rows = table(tmp_path)
        assert {r["status"] for r in rows.values()} == {"changed"}
        assert "d_model: 32 -> 64" in rows["seed=0"]["error"]
        assert not (tmp_path / "runs" / "honest" / "results_mean.csv").read_text().strip()


def test_an_unfinished_run_of_other_settings_is_not_resumed(tmp_path, fake):
    path = write_spec(tmp_path)
    assert run_sweep(path, tmp_path) == 0
    for point in ("seed=0", "seed=1"):  # both interrupted: last.ckpt, no done status
        folder = tmp_path / "runs" / "honest" / point
        (folder / "version_0" / "checkpoints").mkdir()
        (folder / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"")
        (folder / sweep.STATUS_FILE).unlink()
    write_spec(tmp_path, **{"trainer.max_epochs": 5})
    assert run_sweep(path, tmp_path, "--", "--seed_everything", "3") == 0
    # seed_everything from '--' is the same for both points; max_epochs changed for both.
    assert all("--ckpt_path" not in cmd for cmd in fake.commands[2:])
    assert status(tmp_path, "seed=1")["run_dir"].endswith("version_1")
    # Same settings as the unfinished run: it is resumed.
    fake.commands.clear()
    (tmp_path / "runs/honest/seed=0/version_1/checkpoints").mkdir()
    (tmp_path / "runs/honest/seed=0/version_1/checkpoints/last.ckpt").write_bytes(b"")
    (tmp_path / "runs/honest/seed=0" / sweep.STATUS_FILE).unlink()
    assert run_sweep(path, tmp_path, "--", "--seed_everything", "3") == 0
    (cmd,) = fake.commands
    assert cmd[cmd.index("--ckpt_path") + 1] == "last"


def test_shared_args_that_do_not_parse_stop_the_sweep_once(tmp_path, fake, capsys):
    path = write_spec(tmp_path, **{"trainer.max_epochs": "two"})
    assert run_sweep(path, tmp_path) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"macformer_lit sweep: error: {path}: the settings every point")
    assert "trainer.max_epochs" in line and line.endswith("nothing was run"), line
    assert not fake.commands and not (tmp_path / "runs").exists()


def test_a_point_whose_own_settings_do_not_parse_fails_alone_without_starting(
    tmp_path, fake, capsys
):
    path = write_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["axes"]["seed"]["1"]["model.init_args.attention"] = {"name": "no_such_backend"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert run_sweep(path, tmp_path) == 1
    (cmd,) = fake.commands  # only seed=0 started
    assert "seed=0" in cmd
    failed = status(tmp_path, "seed=1")
    assert failed["status"] == "failed" and "no_such_backend" in failed["error"]
    assert "seed=1: FAILED (its settings do not parse)" in capsys.readouterr().out
    assert not list((tmp_path / "runs" / "honest" / "seed=1").glob("version_*"))


def test_a_metrics_row_cut_short_is_flagged_not_tabled(tmp_path, fake):
    path = write_spec(tmp_path)
    assert run_sweep(path, tmp_path) == 0
    metrics = Path(status(tmp_path)["run_dir"]) / "metrics.csv"
    metrics.write_text(metrics.read_text()[:-3])  # "1,6,1.5\n" cut to "1,6,1"
    assert run_sweep(path, tmp_path, "--report_only") == 0
    row = table(tmp_path)["seed=0"]
    assert row["status"] == "bad metrics.csv" and row["val_loss_final"] == ""
    assert f"{metrics}, line 3: the file ends inside this row" in row["error"]
    assert table(tmp_path)["seed=1"]["val_loss_final"] == "1.5"


def test_checking_the_points_prints_no_lightning_warning(tmp_path, fake, monkeypatch):
    """The sweep parses each point's command line in its own process (LightningCLI with
    args while sys.argv is the sweep's): no warning per point reaches the user."""
    import warnings

    monkeypatch.setattr(sys, "argv", ["macformer_lit", "sweep", "s.yaml", "--report_only"])
    path = write_spec(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_sweep(path, tmp_path, "--report_only") == 0
    assert not [w for w in caught if "args parameter is intended" in str(w.message)]
