"""The scripts for a lent GPU machine, run here in their SMOKE mode (tiny shapes, CPU): a
lease is too short to find a broken script there."""

import csv
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from macformer_lit.report import main as report

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["0", "1"])
def test_gpu_paper_runs_packs_each_finished_run_as_results(tmp_path, parallel):
    """Two sweep points, 20 steps each, one after another or at the same time: each one's
    config.yaml and metrics.csv come back in the archive at the path they are committed under,
    without checkpoints, and the report counts them."""
    env = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        SMOKE="1",
        PARALLEL=parallel,
        PYTHON=sys.executable,
        RUNS=str(tmp_path / "runs"),
        # The per-point limit is for a lease; here a loaded machine may need longer.
        LIMIT="1500",
    )
    _paper_runs(
        env,
        "lra_listops_table2.yaml --method=softmax --seed=1",
        "lra_listops_rivals.yaml --method=linear --seed=0",
    )
    with tarfile.open(tmp_path / "out" / "paper_runs.tgz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    results = tmp_path / "unpacked/results/lra_listops"
    for run in (
        "lra_listops_table2/method=softmax,seed=1/version_0",
        "lra_listops_rivals/method=linear,seed=0/version_0",
    ):
        assert sorted(p.name for p in (results / run).iterdir()) == ["config.yaml", "metrics.csv"]
    assert not list((tmp_path / "unpacked").rglob("*.ckpt"))
    assert not list((tmp_path / "out").glob("resume_*.tgz"))  # nothing left to go on with
    report([str(results), "--out", str(tmp_path / "report")])
    table = (tmp_path / "report/report.md").read_text()
    assert "| ListOps | softmax | – | 1 |" in table
    assert "| ListOps | linear | – | 1 |" in table


def _paper_runs(env: dict, *points: str) -> subprocess.CompletedProcess:
    """gpu_paper_runs.sh with these points, run to its end, which must be a success."""
    done = subprocess.run(
        ["bash", "benchmarks/gpu_paper_runs.sh", *points],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


POINT = "lra_listops_table2.yaml --method=softmax --seed=1"
POINT_DIR = "lra_listops_table2/method=softmax,seed=1"


def _lease(tmp_path: Path, name: str) -> dict:
    return dict(
        os.environ,
        OUT=str(tmp_path / name / "out"),
        RUNS=str(tmp_path / name / "runs"),
        DATA_DIR=str(tmp_path / "data"),
        SMOKE="1",
        PYTHON=sys.executable,
        LIMIT="1500",
    )


@pytest.mark.slow
def test_a_point_cut_by_its_limit_goes_on_in_the_next_lease(tmp_path):
    """The first lease's point gets SIGTERM after its first checkpoint (what `timeout` sends at
    LIMIT): it comes back as resume_1.tgz with its checkpoints; unpacked into the next lease's
    RUNS, the same command resumes it in the same run folder and tests it."""
    first = _lease(tmp_path, "lease1")
    script = subprocess.Popen(
        ["bash", "benchmarks/gpu_paper_runs.sh", POINT],
        cwd=ROOT,
        env=first,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    run = Path(first["RUNS"]) / POINT_DIR / "version_0"
    try:
        deadline = time.monotonic() + 1200
        while not list(run.glob("checkpoints/best-*.ckpt")):
            assert script.poll() is None, script.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 20 minutes"
            time.sleep(0.5)
        # The sweep itself, not the `timeout` above it nor the fit below it.
        pattern = f"^[^ ]*python[^ ]* -m macformer_lit sweep .*--runs_dir {first['RUNS']}"
        sweep = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        assert len(sweep.stdout.split()) == 1, sweep.stdout
        os.kill(int(sweep.stdout), signal.SIGTERM)
        out, _ = script.communicate(timeout=600)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == 0, out
    assert "=== unfinished: " + POINT_DIR in out, out
    with tarfile.open(Path(first["OUT"]) / "paper_runs.tgz") as tar:
        assert not [n for n in tar.getnames() if n.startswith("./results/")]
    with tarfile.open(Path(first["OUT"]) / "resume_1.tgz") as tar:
        names = tar.getnames()
        assert POINT_DIR + "/version_0/checkpoints/last.ckpt" in names, names
        assert not [n for n in names if "/wandb" in n or n.endswith(".lock")], names
        cut = [r for r in _rows_from(tar, POINT_DIR) if r["step"]]
    steps_before = max(int(r["step"]) for r in cut)
    assert steps_before < 19, cut  # the point really was cut before its end

    second = _lease(tmp_path, "lease2")
    Path(second["RUNS"]).mkdir(parents=True)
    with tarfile.open(Path(first["OUT"]) / "resume_1.tgz") as tar:
        tar.extractall(second["RUNS"], filter="data")
    done = _paper_runs(second, POINT)
    assert not list(Path(second["OUT"]).glob("resume_*.tgz")), done.stdout
    point = Path(second["RUNS"]) / POINT_DIR
    assert sorted(p.name for p in point.glob("version_*")) == ["version_0"]  # resumed, not anew
    with tarfile.open(Path(second["OUT"]) / "paper_runs.tgz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    result = tmp_path / "unpacked/results/lra_listops" / POINT_DIR / "version_0"
    rows = list(csv.DictReader((result / "metrics.csv").open()))
    assert any(r.get("test/acc") for r in rows)
    assert {int(r["step"]) for r in rows if r["step"]} >= {steps_before, 19}


def _rows_from(tar: tarfile.TarFile, point: str) -> list[dict]:
    text = tar.extractfile(point + "/version_0/metrics.csv").read().decode()
    return list(csv.DictReader(io.StringIO(text)))


def test_gpu_paper_runs_without_points_says_how_to_call_it(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", "benchmarks/gpu_paper_runs.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: bash benchmarks/gpu_paper_runs.sh")
