"""Launch and environment errors through the real CLI (issue 27 part 6): one line naming the
problem and the fix, before anything is built or written where that is possible, and the
error is the last line a user sees.

Each class is tried with more than one instance; the tiny configs are test_misuse.py's.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_misuse import refused, tiny

from macformer_lit import preflight
from macformer_lit.cli import main
from macformer_lit.loggers import check_wandb_mode, unreachable
from macformer_lit.preflight import UsageError, check_launch, check_seeds, disk_full

REPO = Path(__file__).resolve().parents[2]

CLUSTER_VARS = (
    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "WORLD_SIZE", "SLURM_NTASKS", "LSB_JOBID",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "NODE_RANK", "MASTER_ADDR",
)  # fmt: skip
KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """ListOps files for the runs that get as far as training, generated once."""
    root = tmp_path_factory.mktemp("shared")
    main(["fit", *tiny(root, "--trainer.max_steps", "0", "--test_after_fit", "false")])
    return root / "data"


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)


def untiny(args: list[str]) -> list[str]:
    """``tiny``'s arguments without ``--wandb_mode disabled`` (for the W&B cases)."""
    i = args.index("--wandb_mode")
    return args[:i] + args[i + 2 :]


def blackhole() -> tuple[socket.socket, str]:
    """A server that accepts connections and never answers: a network that stalls."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


# ---- multi-node settings without a cluster environment ---------------------------------
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
@pytest.mark.parametrize("nodes", ["2", "4"])
@pytest.mark.parametrize("where", ["flag", "config"])
def test_several_nodes_without_a_launcher_is_one_line(
    tmp_path, capsys, monkeypatch, subcommand, nodes, where
):
    """Before: rank 0 waited forever at "MEMBER: 1/2" with its run folder made."""
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    extra = ["--trainer.num_nodes", nodes]
    if where == "config":
        cfg = tmp_path / "nodes.yaml"
        cfg.write_text(f"trainer:\n  num_nodes: {nodes}\n")
        extra = ["--config", str(cfg)]
    if subcommand == "validate":
        extra += ["--ckpt_path", str(tmp_path / "none.ckpt")]
    line = refused(capsys, [subcommand, *tiny(tmp_path, *extra)], tmp_path)
    assert f"--trainer.num_nodes {nodes}: no cluster launcher found" in line, line
    assert "--trainer.num_nodes 1 --trainer.devices N" in line


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "job"},
        {"TORCHELASTIC_RUN_ID": "x"},
        {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
    ],
)
def test_a_launcher_lets_several_nodes_through(monkeypatch, env):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError):
        check_launch({"num_nodes": 2})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_launch({"num_nodes": 2})


# ---- W&B ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["flag", "environment"])
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_wandb_online_without_a_key_is_one_line(
    tmp_path, capsys, monkeypatch, no_wandb_key, how, subcommand
):
    """Before: a 45-line traceback from wandb's login, once the run had started."""
    args = untiny(tiny(tmp_path))
    if how == "flag":
        args += ["--wandb_mode", "online"]
    else:
        monkeypatch.setenv("WANDB_MODE", "online")
    if subcommand == "validate":
        args += ["--ckpt_path", str(tmp_path / "none.ckpt")]
    line = refused(capsys, [subcommand, *args], tmp_path)
    asked = "--wandb_mode online" if how == "flag" else "WANDB_MODE=online"
    assert f"{asked}: no W&B API key found" in line, line
    assert "wandb login" in line and "--wandb_mode offline" in line


def test_wandb_without_a_key_is_fine_offline_or_guessed(no_wandb_key):
    for mode in ("auto", "offline", "disabled"):
        check_wandb_mode(mode)


def test_an_unreachable_server_is_known_within_the_timeout():
    server, url = blackhole()
    try:
        start = time.monotonic()
        why = unreachable(url, 0.5)
        assert why is not None and time.monotonic() - start < 3
    finally:
        server.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: refused at once
    assert unreachable(f"http://127.0.0.1:{port}", 2) is not None


def not_found_server() -> tuple[object, str]:
    """A server that answers every request with 404: reachable, but no W&B behind it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_HEAD = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    "network",
    ["stalls", pytest.param("answers 404", marks=pytest.mark.slow)],
)
def test_wandb_with_a_key_and_no_network_goes_offline_within_seconds(tmp_path, data_dir, network):
    """Before: wandb.init waited ~90 s for a server that does not answer, then a traceback;
    a server that is no W&B (404) gave a CommError traceback. ~12 s each."""
    server, url = blackhole() if network == "stalls" else not_found_server()
    env = {**os.environ, "WANDB_API_KEY": KEY, "WANDB_BASE_URL": url, "WANDB_PROBE_TIMEOUT": "2"}
    env.pop("WANDB_MODE", None)
    args = untiny(tiny(tmp_path, "--data.data_dir", str(data_dir), "--trainer.max_steps", "1"))
    try:
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "macformer_lit", "fit", *args, "--wandb_mode", "online"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        took = time.monotonic() - start
    finally:
        (server.shutdown if network != "stalls" else server.close)()
    assert proc.returncode == 0, proc.stderr[-3000:]
    why = f"cannot reach {url}" if network == "stalls" else "the server did not start the run"
    assert f"W&B: {why}" in proc.stderr and "logging offline" in proc.stderr, proc.stderr
    assert list((tmp_path / "runs").glob("*/version_0/wandb/offline-run-*"))
    assert "Traceback" not in proc.stderr
    assert took < 90, took  # the probe, not wandb's own 90 s wait


# ---- a model and data of different tasks --------------------------------------------------
@pytest.mark.parametrize(
    "config, data, missing",
    [
        ("translation_synthetic.yaml", "macformer_lit.data.listops.ListOpsDataModule", "bos_id"),
        ("multi30k.yaml", "macformer_lit.data.image.ImageDataModule", "bos_id"),
        (
            "lra_listops.yaml",
            "macformer_lit.data.synthetic_translation.SyntheticTranslationDataModule",
            "num_classes",
        ),
        ("lra_text.yaml", "macformer_lit.data.multi30k.Multi30kDataModule", "num_classes"),
    ],
)
def test_a_model_on_data_of_another_task_is_one_line(tmp_path, capsys, config, data, missing):
    """Before: a 76-line union report ending "'<=' not supported between 'int' and
    'NoneType'", after the translation data had built its tokenizer."""
    argv = ["fit", "--config", config, "--data", data, "--data.data_dir", str(tmp_path / "d"),
            "--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]  # fmt: skip
    line = refused(capsys, argv, tmp_path)
    assert f"does not fit data {data.rsplit('.', 1)[1]}" in line, line
    assert f"needs {missing}" in line and "pair a translation model with translation data" in line
    assert not (tmp_path / "d").exists()


# ---- unbounded schedules ------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--trainer.max_steps", "-1"], "neither --trainer.max_steps nor --trainer.max_epochs"),
        (["--trainer.max_steps", "-1", "--trainer.max_epochs", "-1"], "--trainer.max_epochs -1"),
        (["--trainer.max_steps", "-1", "--trainer.max_time", "00:01:00:00"], "neither"),
        (
            [
                "--trainer.max_steps",
                "-1",
                "--trainer.max_epochs",
                "-1",
                "--trainer.max_time",
                "00:01:00:00",
            ],
            "the linear-decay",
        ),  # fmt: skip
    ],
)
def test_a_fit_without_an_end_is_one_line(tmp_path, capsys, extra, expected):
    """Before: 1000 epochs without a word, or an OverflowError from the schedule."""
    line = refused(capsys, ["fit", *tiny(tmp_path, *extra)], tmp_path)
    assert expected in line, line
    assert "set --trainer.max_steps N or --trainer.max_epochs N" in line


def test_preflight_allows_any_one_bound():
    for trainer in ({"max_steps": 5}, {"max_steps": -1, "max_epochs": 3}, {"max_steps": 0}):
        preflight.check_schedule(trainer, linear_decay=True)
    # Without the tasks' schedule, a time limit alone ends the fit.
    preflight.check_schedule(
        {"max_steps": -1, "max_epochs": -1, "max_time": "1"}, linear_decay=False
    )


# ---- seeds --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "option, value",
    [
        ("--seed_everything", "-1"),
        ("--seed_everything", str(2**32)),
        ("--seed_everything", str(10**23)),
        ("--data.seed", "-3"),
        ("--data.generate_seed", str(2**33)),
        ("--callbacks.redraw.seed", str(2**40)),
    ],
)
def test_an_out_of_range_seed_is_one_line(tmp_path, capsys, option, value):
    """Before: Lightning's or numpy's ValueError as a traceback (a data seed's only once the
    DataModule ran, leaving a run folder)."""
    line = refused(capsys, ["fit", *tiny(tmp_path, option, value)], tmp_path)
    assert f"{option} {value}: a seed must be an integer from 0 to 4294967295" in line, line


def test_every_seed_in_range_passes():
    check_seeds({"seed_everything": 0, "data": {"init_args": {"seed": 2**32 - 1}}})
    check_seeds({"seed_everything": True, "callbacks": {"redraw": {"seed": 7}}})


# ---- report --out ---------------------------------------------------------------------
@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_report_out_naming_a_file_is_one_line(tmp_path, capsys, below):
    """Before: FileExistsError / NotADirectoryError tracebacks after reading every run."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / below if below else tmp_path / "afile"
    with pytest.raises(SystemExit) as err:
        main(["report", str(tmp_path), "--out", str(out)])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"report: error: --out {out}:"), lines
    assert "is a file, not a folder" in lines[0]


# ---- malformed inline YAML ------------------------------------------------------------
@pytest.mark.parametrize(
    "option, value",
    [
        ("--model.init_args.attention", "{name: rmfa, num_features: 64"),
        ("--model.init_args.attention", "{name: 'rmfa}"),
        ("--model.init_args.attention", "[rmfa"),
        ("--trainer", "{max_steps: 2"),
        ("--trainer.callbacks", "[{class_path: x}"),
    ],
)
def test_malformed_inline_yaml_is_one_line(tmp_path, capsys, option, value):
    """Before: taken as a string, then "unknown attention backend '{name: rmfa, ...'" or
    'in "<unicode string>", line 1, column 1'."""
    line = refused(capsys, ["fit", *tiny(tmp_path, option, value)], tmp_path)
    assert line.startswith(f"macformer_lit: error: {option}: YAML value "), line
    assert "not valid YAML" in line and "check its brackets" in line


# ---- an overlay config without a task config ------------------------------------------
@pytest.mark.parametrize(
    "configs",
    [
        ["attention/rmfa_exp.yaml"],
        ["attention/favor.yaml", "schedule/listops_screen.yaml"],
        ["trainer/bf16.yaml"],
        [],
    ],
)
@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_an_overlay_config_alone_names_a_task_config(tmp_path, capsys, configs, subcommand):
    """Before: "model: Option 'attention.name' is not accepted" or "the following arguments
    are required: fit.data, fit.model"."""
    argv = [subcommand, *[a for c in configs for a in ("--config", c)]]
    argv += ["--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]
    line = refused(capsys, argv, tmp_path)
    assert "--config lra_listops.yaml" in line and "task configs: " in line, line
    if configs:
        assert f"--config {configs[0]}" in line and "overlay" in line


def test_an_overlay_before_the_task_config_that_undoes_it_is_one_line(tmp_path, capsys):
    """Before: --config attention/rmfa_exp.yaml --config lra_listops.yaml trained softmax (the
    task config, given later, sets the attention again); an overlay whose options the task
    config does not set (trainer/bf16.yaml) may come first."""
    argv = ["fit", "--config", "attention/rmfa_exp.yaml", "--config", "lra_listops.yaml"]
    argv += ["--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]
    line = refused(capsys, argv, tmp_path)
    start = "macformer_lit: error: --config attention/rmfa_exp.yaml comes before the task "
    start += "config --config "
    assert line.startswith(start + "lra_listops.yaml, which sets model.attention"), line
    assert "give the task config first, --config lra_listops.yaml --config attention/" in line
    preflight.check_task_given(
        ["fit", "--config", str(REPO / "configs/trainer/bf16.yaml"),
         "--config", str(REPO / "configs/lra_listops.yaml")], ["lra_listops.yaml"],
    )  # fmt: skip


# ---- feature counts that cannot fit in memory -----------------------------------------
@pytest.mark.parametrize(
    "backend, extra",
    [("rmfa", ""), ("favor", ""), ("favor", ", recompute: true"), ("rmfa", ", pre_sbn: true")],
)
def test_a_feature_count_beyond_memory_is_refused_with_the_estimate(
    tmp_path, capsys, backend, extra
):
    """Before: the trial build or the first batch was killed by the kernel (exit 137)."""
    have = preflight.physical_memory()
    # tiny: batch 4, 2 heads, max_len 2000: 2 x 4 x 2 x 2000 x 4 bytes per feature.
    features = 2 * have // (2 * 4 * 2 * 2000 * 4) + 1
    spec = f"{{name: {backend}, num_features: {features}{extra}}}"
    line = refused(capsys, ["fit", *tiny(tmp_path, "--model.init_args.attention", spec)], tmp_path)
    assert f"num_features {features:,} cannot fit in memory" in line, line
    assert "GiB, more than this machine's" in line and "lower num_features" in line


def test_a_feature_count_that_fits_passes():
    preflight.check_feature_memory(
        {"name": "rmfa", "num_features": 256}, where="a", batch_size=32, max_len=2000,
        num_heads=2, head_dim=32, num_layers=2,
    )  # fmt: skip


# ---- a disk that fills while metrics are written --------------------------------------
def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("wandb", ["offline", "disabled"])
def test_a_full_disk_while_metrics_are_written_is_the_last_line(tmp_path, data_dir, wandb):
    """Files are limited to 8 kB: config.yaml and provenance.yaml fit, metrics.csv outgrows
    it after ~100 steps (checkpoints off). Before: two tracebacks ("During handling ... another
    exception") and then W&B's "You can sync this run" lines after them."""
    args = tiny(tmp_path, "--data.data_dir", str(data_dir), "--trainer.max_steps", "400",
                "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
                "--trainer.limit_val_batches", "0", "--test_after_fit", "false",
                "--wandb_mode", wandb)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size(8000),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    metrics = next((tmp_path / "runs").glob("*/version_0/metrics.csv"))
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert proc.stderr.strip().splitlines()[-1] == last
    assert last == (
        f"macformer_lit: error: could not write {metrics} (File too "
        "large): the rows written before are intact; free disk space or point --runs_dir at "
        "another disk, then resume with --ckpt_path last"
    ), last
    assert "Traceback" not in proc.stderr
    assert metrics.read_text().endswith("\n")  # whole rows only


def test_a_full_disk_while_the_run_folder_is_made_is_one_line(tmp_path, data_dir):
    """Lightning's own write of config.yaml fails: one line naming it, no folder left."""
    args = tiny(tmp_path, "--data.data_dir", str(data_dir), "--trainer.max_steps", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_file_size(1000),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("macformer_lit: error: could not write "), last
    assert "config.yaml (File too large)" in last and "run it again" in last
    assert not list((tmp_path / "runs").glob("*/version_*"))


def test_disk_full_reads_the_whole_chain():
    inner = OSError(errno.ENOSPC, "No space left on device", "/x/metrics.csv")
    try:
        try:
            raise inner
        except OSError as err:
            raise RuntimeError("wrapped") from err
    except RuntimeError as outer:
        line = disk_full(outer)
    assert line.startswith("could not write /x/metrics.csv (No space left on device)")
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None
