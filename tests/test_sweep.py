import csv
import json
import shlex
from pathlib import Path

import pytest
import yaml

from macformer_lit import sweep

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))


def write_sweep(path, **spec):
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def tiny_args(tmp_path):
    return {
        "data.init_args.data_dir": str(tmp_path / "data"),
        "data.init_args.train_size": 96,
        "data.init_args.val_size": 8,
        "data.init_args.test_size": 8,
        "data.init_args.tokenizer_vocab_size": 300,
        "data.init_args.max_len": 96,
        "data.init_args.batch_size": 32,
        "model.init_args.d_model": 32,
        "model.init_args.num_heads": 2,
        "model.init_args.ffn_dim": 64,
        "model.init_args.num_encoder_layers": 1,
        "model.init_args.num_decoder_layers": 1,
        "model.init_args.warmup_steps": 2,
        "trainer.max_epochs": 2,
        "trainer.accelerator": "cpu",
        "trainer.devices": 1,
        "trainer.enable_progress_bar": False,
        "trainer.log_every_n_steps": 1,
    }


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweep_files_load_and_expand(path):
    spec = sweep.load_sweep(path)
    points = sweep.grid(spec)
    assert len(points) >= 2
    for point in points:
        cmd = sweep.run_command(spec, point, runs_dir=Path("runs"), wandb_mode="disabled", extra=[])
        config = cmd[cmd.index("--config") + 1]
        assert Path(config).is_file(), config  # found beside the sweep file's folder


def test_commands_of_a_grid(tmp_path):
    (tmp_path / "base.yaml").write_text("seed_everything: 1\n")
    (tmp_path / "extra.yaml").write_text("seed_everything: 2\n")
    path = write_sweep(
        tmp_path / "s.yaml",
        name="abl",
        config="base.yaml",
        args={"trainer.max_epochs": 3},
        axes={
            "att": {
                "base": {},
                "pp": {"model.init_args.attention": {"name": "softmax", "pre_sbn": True}},
            },
            "seed": {0: {"seed_everything": 0}, 1: {"seed_everything": 1, "config": "extra.yaml"}},
        },
    )
    spec = sweep.load_sweep(path)
    points = sweep.grid(spec)
    assert [sweep.point_name(p) for p in points] == [
        "att=base,seed=0",
        "att=base,seed=1",
        "att=pp,seed=0",
        "att=pp,seed=1",
    ]
    cmd = sweep.run_command(
        spec,
        points[3],
        runs_dir=tmp_path / "runs",
        wandb_mode="offline",
        extra=["--trainer.fast_dev_run", "true"],
    )
    assert cmd[3] == "fit"
    assert cmd[4:8] == [
        "--config",
        str(tmp_path / "base.yaml"),
        "--config",
        str(tmp_path / "extra.yaml"),
    ]
    text = shlex.join(cmd)
    assert '--model.init_args.attention \'{"name": "softmax", "pre_sbn": true}\'' in text
    assert f"--runs_dir {tmp_path / 'runs' / 'abl'} --experiment att=pp,seed=1" in text
    assert text.endswith("--ckpt_path last --trainer.fast_dev_run true")
    assert sweep.parse_point(spec, ["--att=pp", "--seed", "1"]) == points[3]
    with pytest.raises(sweep.SweepError, match="not a label of att"):
        sweep.parse_point(spec, ["--att=xx", "--seed=1"])
    with pytest.raises(sweep.SweepError, match="no label for axis seed"):
        sweep.parse_point(spec, ["--att=pp"])
    wb = sweep.wandb_sweep_config(spec, tmp_path / "runs", "online", [])
    assert wb["method"] == "grid" and wb["parameters"]["seed"] == {"values": ["0", "1"]}
    assert wb["command"][-2:] == ["--point", "${args}"]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"axes": {}}, "'axes' must map"),
        ({"axes": {"a": {"x": 3}}}, "overrides must be a mapping"),
        ({"axes": {"a": {"x": {}}}, "colour": 1}, "unknown key"),
        ({"axes": {"a": {"x": {}}}, "plot": {"style_axis": "b"}}, "style_axis 'b' is not an axis"),
        ({"axes": {"a": {"x y": {}}}}, "must be a plain word"),
        ({"axes": {"a": {"x": {}}}, "plot": {"metric": ["val/acc"]}}, "plot has unknown key"),
        ({"axes": {"a": {"x": {}}}, "plot": {"x": "time"}}, "plot.x must be epoch or step"),
    ],
)
def test_malformed_sweep_files(tmp_path, bad, match, capsys):
    path = write_sweep(tmp_path / "bad.yaml", **bad)
    with pytest.raises(sweep.SweepError, match=match):
        sweep.load_sweep(path)
    with pytest.raises(SystemExit) as err:
        sweep.main([str(path)])
    assert err.value.code == 2 and "error:" in capsys.readouterr().err


def test_tables_average_over_seeds(tmp_path):
    table = [
        {"run": f"a={a},seed={s}", "a": a, "seed": s, "status": "done", "val_bleu_best": b}
        for a, s, b in (
            ("x", "0", 10.0),
            ("x", "1", 14.0),
            ("y", "0", 20.0),
            ("y", "1", 20.0),
            ("z", "0", 7.0),
        )
    ]
    table.append(
        {
            "run": "a=y,seed=2",
            "a": "y",
            "seed": "2",
            "status": "failed (exit 1)",
            "val_bleu_best": None,
            "error": "ValueError: boom",
        }
    )
    means = sweep.averaged(table, ["a", "seed"], ["seed"])
    # Sample standard deviation (n-1): 10 and 14 give 2√2, not the population's 2; one run
    # has none.
    assert means == [
        {"a": "x", "runs": 2, "val_bleu_best_mean": 12.0, "val_bleu_best_std": 8**0.5},
        {"a": "y", "runs": 2, "val_bleu_best_mean": 20.0, "val_bleu_best_std": 0.0},
        {"a": "z", "runs": 1, "val_bleu_best_mean": 7.0, "val_bleu_best_std": None},
    ]
    md, _ = sweep.write_tables(means, tmp_path, "mean", note="± is the sample std")
    text = md.read_text()
    assert "| a | runs | val_bleu_best |" in text and "| x | 2 | 12 ± 2.8 |" in text
    assert "| y | 2 | 20 ± 0 |" in text and "| z | 1 | 7 |" in text
    assert text.endswith("\n± is the sample std\n")
    md, csv_path = sweep.write_tables(table, tmp_path, "all")
    assert "- `a=y,seed=2`: ValueError: boom" in md.read_text()
    assert next(csv.DictReader(open(csv_path)))["val_bleu_best"] == "10.0"


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """A finished two-point sweep of real CLI runs: (sweep file, argv, its output folder)."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    path = write_sweep(
        tmp_path / "tiny.yaml",
        name="tiny",
        config=str(REPO / "configs" / "translation_synthetic.yaml"),
        args=tiny_args(tmp_path),
        axes={"ppsbn": {"baseline": {}, "variant": {"model.init_args.label_smoothing": 0.0}}},
        plot={"style_axis": "ppsbn", "dashed": ["baseline"]},
    )
    argv = [str(path), "--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"]
    assert sweep.main(argv) == 0
    return path, argv, tmp_path / "runs" / "tiny"


def test_two_point_grid_end_to_end(tiny_sweep, capsys):
    _, argv, out_dir = tiny_sweep
    rows = list(csv.DictReader(open(out_dir / "results.csv")))
    assert [r["run"] for r in rows] == ["ppsbn=baseline", "ppsbn=variant"]
    for row in rows:
        assert row["status"] == "done" and row["epochs"] == "2"
        for key in (
            "val_loss_final",
            "val_loss_best",
            "val_ppl_final",
            "val_ppl_best",
            "val_bleu_final",
            "val_bleu_best",
            "test_bleu",
            "test_bleu_tok",
            "time_s",
            "peak_mem_mb",
            "tokens_per_s",
        ):
            assert row[key] != "", key
        assert float(row["val_loss_best"]) <= float(row["val_loss_final"])
    md = (out_dir / "results.md").read_text()
    assert md.count("| ppsbn=") == 2 and "val_bleu_best" in md
    png = (out_dir / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    # A second call finds both runs finished and starts nothing.
    capsys.readouterr()
    assert sweep.main(argv) == 0
    assert capsys.readouterr().out.count("done before, skipped") == 2
    assert sorted(p.name for p in (out_dir / "ppsbn=baseline").iterdir() if p.is_dir()) == [
        "version_0"
    ]


def test_curves_colour_each_method_with_a_band_over_seeds(tiny_sweep, tmp_path, monkeypatch):
    """Two methods x two seeds, their runs the sweep's real ones: method a's seeds are the
    baseline and the variant run, method b's the variant run twice."""
    _, _, out_dir = tiny_sweep
    spec = sweep.load_sweep(
        write_sweep(
            tmp_path / "methods.yaml",
            name="methods",
            config=str(REPO / "configs" / "translation_synthetic.yaml"),
            axes={"att": {"a": {}, "b": {}}, "seed": {"1": {}, "2": {}}},
            plot={"style_axis": "att", "dashed": ["a"], "metrics": ["val/loss", "val/bleu"]},
        )
    )
    points = sweep.grid(spec)
    runs = {
        r: sweep.read_status(out_dir / f"ppsbn={r}")["run_dir"] for r in ("baseline", "variant")
    }
    statuses = [{"run_dir": runs[r]} for r in ("baseline", "variant", "variant", "variant")]
    curves = sweep.method_curves(spec, points, statuses, "val/loss")
    loss = {
        r: [(e + 1.0, v) for e, v in sweep.series(sweep.read_metrics(d), "val/loss")]
        for r, d in runs.items()
    }
    assert curves == {
        "att=a": [loss["baseline"], loss["variant"]],
        "att=b": [loss["variant"], loss["variant"]],
    }
    assert loss["baseline"] != loss["variant"] and len(loss["baseline"]) == 2
    drawn = []

    def record(ax, curves, **kwargs):
        drawn.append((curves, kwargs))
        sweep_plot_bands(ax, curves, **kwargs)

    sweep_plot_bands = sweep.plot_bands
    monkeypatch.setattr(sweep, "plot_bands", record)
    png = sweep.plot_curves(spec, points, statuses, tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert [list(c) for c, _ in drawn] == [["att=a", "att=b"]] * 2
    colours, styles = drawn[0][1]["colours"], drawn[0][1]["linestyles"]
    assert colours["att=a"] != colours["att=b"] and drawn[1][1]["colours"] == colours
    assert styles == {"att=a": "--", "att=b": "-"}


def test_a_failed_run_is_reported_not_fatal(tmp_path):
    path = write_sweep(
        tmp_path / "fails.yaml",
        name="fails",
        config=str(REPO / "configs" / "translation_synthetic.yaml"),
        args=tiny_args(tmp_path),
        axes={"att": {"broken": {"model.init_args.attention": {"name": "no_such_backend"}}}},
    )
    with pytest.raises(SystemExit) as err:
        sweep.main([str(path), "--runs_dir", str(tmp_path / "runs"), "--wandb_mode", "disabled"])
    assert err.value.code == 1
    out_dir = tmp_path / "runs" / "fails"
    status = json.loads((out_dir / "att=broken" / sweep.STATUS_FILE).read_text())
    assert status["status"] == "failed" and status["returncode"] != 0
    assert "no_such_backend" in status["error"]
    md = (out_dir / "results.md").read_text()
    assert "failed (exit" in md and "no_such_backend" in md
    assert (out_dir / "curves.png").is_file()


def failing_sweep(tmp_path):
    return write_sweep(
        tmp_path / "fix.yaml",
        name="fix",
        config=str(REPO / "configs" / "translation_synthetic.yaml"),
        args=tiny_args(tmp_path),
        axes={"att": {"x": {"model.init_args.attention": {"name": "no_such_backend"}}}},
    )


RUNS = ["--wandb_mode", "disabled"]
FIX = ["--", "--model.init_args.attention", "{name: softmax}", "--trainer.max_steps", "1"]


def test_dry_run_and_wandb_sweep_carry_the_arguments_after_the_separator(tmp_path, capsys):
    path = failing_sweep(tmp_path)
    runs, fix = ["--runs_dir", str(tmp_path / "runs"), *RUNS], FIX
    assert sweep.main([str(path), *runs, "--dry_run", *fix]) == 0
    (command,) = capsys.readouterr().out.strip().splitlines()
    assert "--trainer.max_steps 1" in command and "'{name: softmax}'" in command
    wb = tmp_path / "wb.yaml"
    assert sweep.main([str(path), *runs, "--wandb_sweep", str(wb), *fix]) == 0
    assert "--trainer.max_steps" in wb.read_text() and "{name: softmax}" in wb.read_text()
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_failed_point_no_retry_rerun_and_report_only(tmp_path, capsys):
    """A point that fails is skipped with --no_retry_failed, retried (and fixed by the
    arguments after '--') on a plain rerun; --report_only runs nothing."""
    path = failing_sweep(tmp_path)
    runs, fix = ["--runs_dir", str(tmp_path / "runs"), *RUNS], FIX
    folder = tmp_path / "runs" / "fix" / "att=x"
    with pytest.raises(SystemExit) as err:
        sweep.main([str(path), *runs])
    assert err.value.code == 1
    failed = json.loads((folder / sweep.STATUS_FILE).read_text())
    assert failed["status"] == "failed"
    with pytest.raises(SystemExit):
        sweep.main([str(path), *runs, "--no_retry_failed", *fix])
    assert "att=x: failed before, skipped (--no_retry_failed)" in capsys.readouterr().out
    assert json.loads((folder / sweep.STATUS_FILE).read_text()) == failed

    assert sweep.main([str(path), *runs, *fix]) == 0
    done = json.loads((folder / sweep.STATUS_FILE).read_text())
    assert done["status"] == "done" and "--trainer.max_steps 1" in done["command"]
    log = (folder / sweep.LOG_FILE).read_text()
    assert log.count("\n$ ") + log.startswith("$ ") == 2

    capsys.readouterr()
    assert sweep.main([str(path), *runs, "--report_only"]) == 0
    assert "att=x" in capsys.readouterr().out
    assert (folder / sweep.LOG_FILE).read_text() == log


def test_curves_by_step_and_the_majority_line(tmp_path):
    """``plot.x: step`` draws a run inside one epoch as its logged steps (by epoch it would be
    one point), and the accuracy panel gets the majority-class line the runs logged."""
    path = write_sweep(
        tmp_path / "s.yaml",
        command="fit",
        axes={"method": {"a": {}}},
        plot={"metrics": ["val/acc"], "x": "step"},
    )
    spec = sweep.load_sweep(path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "epoch,step,val/acc,val/majority_acc\n0,299,0.2,0.17\n0,599,0.3,0.17\n"
    )
    statuses = [{"run_dir": str(run)}]
    curves = sweep.method_curves(spec, [{"method": "a"}], statuses, "val/acc")
    assert curves == {"method=a": [[(299.0, 0.2), (599.0, 0.3)]]}
    assert sweep.majority_share(statuses) == 0.17
    spec["plot"]["x"] = "epoch"
    assert sweep.method_curves(spec, [{"method": "a"}], statuses, "val/acc") == {
        "method=a": [[(1.0, 0.3)]]
    }
    out = sweep.plot_curves(spec, [{"method": "a"}], statuses, tmp_path / "curves.png")
    assert out.stat().st_size > 0
