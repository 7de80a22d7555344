"""The scripts for a lent GPU machine, run here in their SMOKE mode (tiny shapes, CPU): a
lease is too short to find a broken script there."""

import os
import subprocess
import sys
import tarfile
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
        # The per-point limit is for a lease; here a loaded machine may need longer.
        LIMIT="1500",
    )
    done = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_paper_runs.sh",
            "lra_listops_table2.yaml --method=softmax --seed=1",
            "lra_listops_rivals.yaml --method=linear --seed=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with tarfile.open(tmp_path / "out" / "paper_runs.tgz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    results = tmp_path / "unpacked/results/lra_listops"
    for run in (
        "lra_listops_table2/method=softmax,seed=1/version_0",
        "lra_listops_rivals/method=linear,seed=0/version_0",
    ):
        assert sorted(p.name for p in (results / run).iterdir()) == ["config.yaml", "metrics.csv"]
    assert not list((tmp_path / "unpacked").rglob("*.ckpt"))
    report([str(results), "--out", str(tmp_path / "report")])
    table = (tmp_path / "report/report.md").read_text()
    assert "| ListOps | softmax | – | 1 |" in table
    assert "| ListOps | linear | – | 1 |" in table


def test_gpu_paper_runs_without_points_says_how_to_call_it(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", "benchmarks/gpu_paper_runs.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: bash benchmarks/gpu_paper_runs.sh")
