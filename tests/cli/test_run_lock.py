"""One writer per run folder, between real processes: a run holds its version folder's lock
while it runs, a second process on that folder (a resume of the same experiment, a sweep of
the same sweep folder or point) stops with one line naming the holder's PID, and the lock of
a killed process is taken over, saying so. Two ``fit --ckpt_path last`` of one experiment
used to both write ``version_0``, their ``metrics.csv`` rows interleaved."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_run import tiny_listops

from macformer_lit import cli, locks, sweep
from macformer_lit.cli import main

REPO = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from macformer_lit import locks; locks.hold(sys.argv[1], 'fit'); "
    "print('held', flush=True); time.sleep(120)"
)


def tiny(root: Path, *extra: str) -> list[str]:
    own = ["--experiment", "a", "--trainer.val_check_interval", "2"]
    quiet = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]
    return [
        "fit",
        *tiny_listops(root / "data", root / "runs", *own, *quiet, *extra, small_model=True),
    ]


def probe(folder: Path) -> subprocess.CompletedProcess:
    """Another process trying to lock ``folder``."""
    code = "import sys; from macformer_lit import locks; print(locks.hold(sys.argv[1], 'x'))"
    return subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60
    )


class Holder:
    """A process holding ``folder``'s lock until stopped."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "held"
        self.pid = self.proc.pid

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def holders():
    made: list[Holder] = []
    yield lambda folder: made.append(Holder(folder)) or made[-1]
    for h in made:
        if h.proc.poll() is None:
            h.kill()


@pytest.mark.slow  # ~2 min loaded; a second sweep of a held folder stops by default
def test_a_run_holds_its_folder_and_a_resume_beside_it_stops(
    tmp_path, monkeypatch, capsys, holders
):
    seen = {}

    def during_fit(self):  # the run is set up, its loop about to start: try from outside
        seen["probe"] = probe(self.run_dir)

    with monkeypatch.context() as mp:
        mp.setattr(cli.MacformerCLI, "before_fit", during_fit)
        main(tiny(tmp_path, "--trainer.max_steps", "2"))
    run = tmp_path / "runs" / "a" / "version_0"
    assert seen["probe"].returncode != 0
    assert f"{run} is in use by PID {__import__('os').getpid()} (fit, since" in seen["probe"].stderr
    # Ended: released cleanly, so the next holder has nobody to take over from.
    assert probe(run).stdout.strip() == "None"

    # A run in version_0 (here a process holding its lock) and a resume of the experiment.
    rows = (run / "metrics.csv").read_text()
    other = holders(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        main(tiny(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", "last"))
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"macformer_lit: error: {run} is in use by PID {other.pid} (fit"), line
    assert (run / "metrics.csv").read_text() == rows
    assert sorted(p.name for p in (tmp_path / "runs" / "a").iterdir()) == ["version_0"]

    # Killed without releasing: the next run takes the folder over and says whose it was.
    other.kill()
    main(tiny(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert f"{run}: taken over from PID {other.pid} (fit, since" in err, err
    assert "ended without releasing it" in err


def sweep_file(tmp_path) -> Path:
    path = tmp_path / "s.yaml"
    spec = {
        "name": "locked",
        "config": str(REPO / "configs" / "translation_synthetic.yaml"),
        "args": {"data.init_args.data_dir": str(tmp_path / "data")},
        "axes": {"seed": {"0": {"seed_everything": 0}}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_second_sweep_of_the_same_folder_or_point_stops(tmp_path, capsys, holders, monkeypatch):
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(sweep, "_run_child", lambda *a, **k: pytest.fail("a run started"))
    path = sweep_file(tmp_path)
    argv = [str(path), "--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]
    other = holders(tmp_path / "runs" / "locked")
    with pytest.raises(SystemExit) as err:
        sweep.main(argv)
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"sweep: error: {tmp_path / 'runs' / 'locked'} is in use by PID {other.pid}" in line
    other.kill()

    # A --point agent on a point another process holds: skipped, named, not done.
    point = holders(tmp_path / "runs" / "locked" / "seed=0")
    monkeypatch.setattr(sweep, "plot_curves", lambda spec, points, statuses, path: path)
    with pytest.raises(SystemExit) as err:
        sweep.main([*argv, "--point", "--seed=0"])
    assert err.value.code == 1
    out = capsys.readouterr().out
    assert f"seed=0: skipped: {tmp_path / 'runs' / 'locked' / 'seed=0'} is in use by PID" in out
    assert str(point.pid) in out
    assert not locks._HELD  # the sweep released what it held
