"""Interruptions lose nothing: real processes, real signals, sent at a known point.

``PauseAt`` (a callback the runs load from this file) stops the run at a chosen hook and
step, writes a marker file and waits there; the test waits for the marker, then sends the
signal from outside, so the signal always lands in that phase (training, validation,
checkpointing, a test loop) and never by timing luck.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

HERE = Path(__file__).resolve().parent


class PauseAt(L.Callback):
    """Pause at ``$PAUSE_AT`` (``train:<step>``, ``validation:<step>``, ``checkpoint:<step>``
    or ``test``) until a stop signal arrives; ``$PAUSE_MARK`` is written on arrival."""

    def _pause(self, trainer) -> None:
        Path(os.environ["PAUSE_MARK"]).write_text(str(os.getpid()))
        os.environ.pop("PAUSE_AT")  # once
        deadline = time.time() + 60
        while time.time() < deadline and not trainer.received_sigterm:
            time.sleep(0.02)  # a signal outside a graceful fit raises here

    def _at(self, phase: str, trainer) -> bool:
        want = os.environ.get("PAUSE_AT", "")
        if not want.startswith(phase):
            return False
        step = want.partition(":")[2]
        return not step or trainer.global_step == int(step)

    def on_train_batch_end(self, trainer, *args) -> None:
        if self._at("train", trainer):
            self._pause(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *a):
        if not trainer.sanity_checking and batch_idx == 0 and self._at("validation", trainer):
            self._pause(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self._at("checkpoint", trainer):
            self._pause(trainer)

    def on_test_batch_end(self, trainer, *args) -> None:
        if self._at("test", trainer):
            self._pause(trainer)

    on_predict_batch_end = on_test_batch_end


def _env(**extra) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


def _fit_args(tmp: Path, experiment: str, *extra: str) -> list[str]:
    probe = tmp / "probe.yaml"
    probe.write_text("trainer:\n  callbacks:\n    - class_path: test_interruptions.PauseAt\n")
    return [
        sys.executable,
        "-m",
        "macformer_lit",
        "fit",
        "--config",
        "lra_listops.yaml",
        "--config",
        str(probe),
        "--data.data_dir",
        str(tmp.parent / "data"),  # shared by the tests of a module: generated once
        "--data.train_size",
        "16",
        "--data.val_size",
        "8",
        "--data.test_size",
        "4",
        "--data.batch_size",
        "4",
        "--model.init_args.d_model",
        "16",
        "--model.init_args.num_layers",
        "1",
        "--model.init_args.lr",
        "3e-3",
        "--model.init_args.warmup_steps",
        "1",
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.deterministic",
        "true",
        "--trainer.enable_progress_bar",
        "false",
        "--runs_dir",
        str(tmp / "runs"),
        "--experiment",
        experiment,
        "--wandb_mode",
        "disabled",
        "--test_after_fit",
        "false",
        *extra,
    ]


def _run(args, cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300
    )


def _interrupt(args, cwd, pause: str, signum: int, **popen) -> tuple[int, str, str]:
    """Start ``args``, wait until it pauses at ``pause``, send ``signum``; its exit code,
    stdout and stderr."""
    mark = Path(cwd) / f"paused-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=_env(PAUSE_AT=pause, PAUSE_MARK=str(mark)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    deadline = time.time() + 240
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert mark.exists(), proc.communicate()[1][-3000:]
    if popen.get("start_new_session"):
        os.killpg(proc.pid, signum)  # as a terminal does: the whole foreground group
    else:
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


# Columns that measure the machine, not the training. The epoch aggregates of training
# metrics (train/loss_epoch, train/acc) are compared: every interruption below lands inside
# an epoch that ends after the resume, and EpochAccumulatorsCheckpoint carries what the
# epoch had summed so far, so they are equal bit for bit (one process, the same order of
# float additions).
SKIP = ("time", "throughput", "memory", "rss", "_per_sec")


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kept = [{k: v for k, v in r.items() if v and not any(t in k for t in SKIP)} for r in rows]
    return [r for r in kept if set(r) - {"step", "epoch"}]


def _checkpoints(run: Path) -> dict[str, dict]:
    out = {}
    for p in sorted((run / "checkpoints").glob("*.ckpt")):
        ckpt = torch.load(p, weights_only=False, map_location="cpu")
        out[p.name] = {"step": ckpt["global_step"], "state": ckpt["state_dict"]}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the tiny fit every interrupted run is compared with."""
    tmp = tmp_path_factory.mktemp("ref")
    done = _run(_fit_args(tmp, "ref"), tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs/ref/version_0"


def _same_as_reference(reference: Path, run: Path) -> None:
    assert _rows(run) == _rows(reference)
    ref, got = _checkpoints(reference), _checkpoints(run)
    assert sorted(got) == sorted(ref)  # the same best checkpoint, by name (its step)
    for name in ref:
        assert got[name]["step"] == ref[name]["step"], name
        for key, value in ref[name]["state"].items():
            torch.testing.assert_close(got[name]["state"][key], value, msg=f"{name}: {key}")


CASES = [
    # (phase, signal): at least one fast case per class, the rest with -m slow.
    ("validation:4", signal.SIGTERM),
    ("train:3", signal.SIGHUP),
    pytest.param("checkpoint:2", signal.SIGINT, marks=pytest.mark.slow),
    pytest.param("validation:2", signal.SIGHUP, marks=pytest.mark.slow),
    pytest.param("validation:4", signal.SIGINT, marks=pytest.mark.slow),
    pytest.param("train:5", signal.SIGTERM, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("pause", "signum"), CASES)
def test_interrupted_fit_resumes_to_the_uninterrupted_run(reference, tmp_path, pause, signum):
    args = _fit_args(tmp_path, "cut")
    code, out, err = _interrupt(args, tmp_path, pause, signum)
    assert code == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "saved" in err and "resume with" in err, err[-3000:]
    run = tmp_path / "runs/cut/version_0"
    step = torch.load(run / "checkpoints/last.ckpt", weights_only=False)["global_step"]
    assert step < 6
    resumed = _run([*args, "--ckpt_path", "last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_as_reference(reference, run)


def test_closed_stdout_never_fails_a_run(reference, tmp_path):
    """``fit ... | head -3``: the reader goes away after three lines."""
    args = _fit_args(tmp_path, "head")
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    _same_as_reference(reference, tmp_path / "runs/head/version_0")


def _eval_args(reference: Path, tmp: Path, subcommand: str) -> list[str]:
    args = _fit_args(tmp, "scored")
    args[args.index("fit")] = subcommand
    cut = args.index("--test_after_fit")
    del args[cut : cut + 2]
    return [*args, "--ckpt_path", str(reference / "checkpoints/last.ckpt")]


@pytest.mark.parametrize(
    "subcommand",
    [
        "test",
        pytest.param("validate", marks=pytest.mark.slow),
        pytest.param("predict", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_in_an_evaluation_is_one_line_and_leaves_no_folder(reference, tmp_path, subcommand):
    pause = "validation" if subcommand == "validate" else "test"
    args = _eval_args(reference, tmp_path, subcommand)
    code, out, err = _interrupt(args, tmp_path, pause, signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"macformer_lit: {subcommand} interrupted")
    assert not (tmp_path / "runs/scored").exists()


def _tiny_sweep(tmp_path: Path) -> tuple[Path, list[str]]:
    """A one-point sweep of the tiny fit (with ``PauseAt``) and the command that runs it."""
    fit = _fit_args(tmp_path, "unused")
    shared = fit[fit.index("--data.data_dir") : fit.index("--runs_dir")]
    sweep = tmp_path / "tiny.yaml"
    probe = tmp_path / "probe.yaml"
    pairs = dict(zip(shared[::2], shared[1::2]))
    args_yaml = "".join(f"  {k[2:]}: {v!r}\n" for k, v in pairs.items())
    sweep.write_text(
        "name: tiny\ncommand: fit\n"
        f"config: [lra_listops.yaml, {probe}]\n"
        f"args:\n{args_yaml}  test_after_fit: false\n"
        "axes:\n  seed:\n    '0': {seed_everything: 0}\n"
    )
    cmd = [sys.executable, "-m", "macformer_lit", "sweep", str(sweep), "--runs_dir", "runs"]
    return sweep, cmd + ["--wandb_mode", "disabled"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has stopped; only its parent's wait is missing


@pytest.mark.slow  # ~2 min loaded; a sweep stopped by Ctrl-C runs by default
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_sweep_killed_outright_stops_its_point_with_a_checkpoint(tmp_path):
    """SIGKILL (the OOM killer, kill -9) gives the sweep no chance to pass a signal on: its
    point, in a session of its own, used to train on unwatched. It gets SIGTERM from the
    kernel instead, saves last.ckpt and stops; running the sweep again goes on from it."""
    sweep, cmd = _tiny_sweep(tmp_path)
    mark = tmp_path / "paused"
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(PAUSE_AT="train:3", PAUSE_MARK=str(mark)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert mark.exists(), "the point never reached step 3"
    point = int(mark.read_text())
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.time() + 120
    while _alive(point) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(point), "the point trained on after its sweep was killed"
    ckpt = tmp_path / "runs/tiny/seed=0/version_0/checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    again = _run(cmd, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6


def test_ctrl_c_in_a_sweep_saves_the_point_and_says_how_to_go_on(tmp_path):
    sweep, cmd = _tiny_sweep(tmp_path)
    code, out, err = _interrupt(cmd, tmp_path, "train:3", signal.SIGINT, start_new_session=True)
    assert code == 130, out[-2000:] + err[-3000:]
    assert "Traceback" not in err + out, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("macformer_lit sweep: interrupted (Ctrl-C)"), err[-3000:]
    assert f"sweep {sweep}" in last
    ckpt = tmp_path / "runs/tiny/seed=0/version_0/checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    # Going on finishes the point from its checkpoint, in the same run folder.
    again = _run(cmd, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6
    assert not (tmp_path / "runs/tiny/seed=0/version_1").exists()


GENERATE = """
import sys
from macformer_lit.data.listops import ListOpsDataModule
dm = ListOpsDataModule(data_dir=sys.argv[1], train_size=int(sys.argv[2]), val_size=8,
                       test_size=8, generate_processes=1)
dm.prepare_data()
"""


def test_killed_generation_leaves_no_temporaries_and_no_half_file(tmp_path):
    data = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-c", GENERATE, str(data), "2000000"], env=_env())
    deadline = time.time() + 120
    staged = []
    while not staged and proc.poll() is None and time.time() < deadline:
        staged = [p for p in data.rglob("*") if ".tmp" in p.name and p.stat().st_size > 0]
        time.sleep(0.05)
    assert staged, "generation never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert [p for p in data.rglob("*") if ".tmp" in p.name]  # what SIGKILL leaves
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(data), "16"], env=_env(), capture_output=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p for p in data.rglob("*") if ".tmp" in p.name]
    # Only whole files were ever put in place: every row of the train split parses.
    train = next(p for p in data.rglob("*train*") if p.is_file() and p.suffix == ".tsv")
    rows = train.read_text().splitlines()
    assert rows[0].split("\t") == ["Source", "Target"] and len(rows) == 17


class _SignalInFinaliser:
    def __del__(self):
        # The handler runs inside raise_signal, here, where Python cannot propagate its
        # exception: what a signal landing in the pool's fork (an at-fork hook) met.
        signal.raise_signal(signal.SIGTERM)


def test_a_signal_whose_exception_python_swallows_is_delivered_again():
    from macformer_lit import interrupts

    previous = interrupts.install()
    try:
        with pytest.raises(interrupts.Interrupted, match="SIGTERM"):
            _SignalInFinaliser()  # dropped at once: its finaliser runs
            deadline = time.time() + 10
            while time.time() < deadline:
                time.sleep(0.001)
    finally:
        interrupts.restore(previous)
    assert sys.unraisablehook is not interrupts._unraisable


@pytest.mark.slow
def test_sigterm_during_generation_in_fit_removes_its_files_and_folder(tmp_path):
    # It used to train on and exit 0 when the signal landed while the generator pool
    # forked its workers (the handler then runs in an at-fork hook; its exception is lost).
    args = _fit_args(tmp_path, "gen")
    args[args.index("--data.train_size") + 1] = "2000000"
    args[args.index("--data.data_dir") + 1] = str(tmp_path / "own_data")
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    data = tmp_path / "own_data"
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline:
        if data.exists() and [p for p in data.rglob("*") if ".tmp" in p.name]:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("macformer_lit: fit interrupted (SIGTERM)")
    assert not [p for p in data.rglob("*") if ".tmp" in p.name]
    assert not (tmp_path / "runs/gen").exists()


def _wandb_records(run_file: Path) -> list[str]:
    """The record types in an offline W&B run file, in order (what ``wandb sync`` sends)."""
    from wandb.proto import wandb_internal_pb2

    # LevelDB's log format behind W&B's 7-byte header: 32 KiB blocks of fragments, each
    # with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    raw, block, kinds, pending = run_file.read_bytes(), 32768, [], b""
    pos = 7
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if kind == 0 and length == 0:
            break  # zero padding: the end of what was written
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            kinds.append(record.WhichOneof("record_type"))
            pending = b""
    return kinds


def test_a_run_stopped_by_sigterm_is_preempted_in_wandb_not_failed(tmp_path):
    """The offline W&B run of a fit stopped on purpose (last.ckpt saved, exit 143) carries
    W&B's preempting record, so a synced run shows preempted and a crash stays a crash."""
    args = _fit_args(tmp_path, "wb")
    args[args.index("--wandb_mode") + 1] = "offline"
    mark = tmp_path / "paused"
    env = {**_env(PAUSE_AT="train:3", PAUSE_MARK=str(mark)), "WANDB_MODE": "offline"}
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while not mark.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert mark.exists(), proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    (run_file,) = (tmp_path / "runs/wb").rglob("*.wandb")
    kinds = _wandb_records(run_file)
    assert "preempting" in kinds, kinds
    assert kinds.index("preempting") < kinds.index("exit")
