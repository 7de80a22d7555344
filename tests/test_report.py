"""``report`` on real CLI runs: tiny ListOps fits of softmax (two seeds, and one with another
tokenizer), RMFA-exp + ppSBN, an unfinished fit, and folders that are not runs."""

import csv
import math
import shutil
import statistics

import pytest

from macformer_lit import cli, report
from macformer_lit.plotting import colours_for, legend_below, plot_bands, pyplot
from macformer_lit.report import backend_label, main, row_name

PNG = b"\x89PNG\r\n\x1a\n"


def fit(root, experiment, seed, *extra):
    """One tiny ListOps fit through the real CLI: 4 steps, validation every 2, telemetry
    every step, trees of 20-120 tokens generated once into ``root/data``."""
    cli.main(
        [
            "fit",
            "--config",
            "lra_listops.yaml",
            *extra,
            "--trainer.max_steps",
            "4",
            "--trainer.val_check_interval",
            "2",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--data.train_size",
            "64",
            "--data.val_size",
            "16",
            "--data.test_size",
            "16",
            "--data.batch_size",
            "16",
            "--data.max_len",
            "128",
            "--data.generate_min_length",
            "20",
            "--data.generate_max_length",
            "120",
            "--data.generate_processes",
            "1",
            "--data.data_dir",
            str(root / "data"),
            "--runs_dir",
            str(root / "runs"),
            "--experiment",
            experiment,
            "--wandb_mode",
            "disabled",
            "--seed_everything",
            str(seed),
            "--callbacks.telemetry.every_n_steps",
            "1",
        ]
    )
    return root / "runs" / experiment / "version_0"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    made = {
        "softmax1": fit(root, "softmax1", 1),
        "softmax2": fit(root, "softmax2", 2),
        "rmfa": fit(root, "rmfa", 1, "--config", "attention/rmfa_exp.yaml"),
        "skyformer": fit(root, "skyformer", 1, "--data.tokenizer", "skyformer"),
        "unfinished": fit(root, "unfinished", 3, "--test_after_fit", "false"),
    }
    # A second copy of seed 1's run (a rerun into another folder): it must count once.
    made["rerun"] = root / "runs" / "rerun"
    shutil.copytree(made["softmax1"], made["rerun"])
    # A fit whose config asked for more steps than it ran, yet logged a test accuracy.
    made["stopped"] = root / "runs" / "stopped"
    shutil.copytree(made["rmfa"], made["stopped"])
    config = made["stopped"] / "config.yaml"
    assert "  max_steps: 4\n" in config.read_text()
    config.write_text(config.read_text().replace("  max_steps: 4\n", "  max_steps: 8\n"))
    (root / "runs" / "junk").mkdir()
    (root / "runs" / "junk" / "notes.txt").write_text("not a run\n")
    (root / "runs" / "broken").mkdir()
    (root / "runs" / "broken" / "config.yaml").write_text("model: [unclosed\n")
    (root / "runs" / "broken" / "metrics.csv").write_text("step,test/acc\n0,0.5\n")
    out = root / "out"
    cli.main(["report", str(root / "runs"), "--out", str(out)])
    return made, out


def logged(run_dir, key):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def last_nmse(run_dir, quantity):
    """Mean over layers of each layer's last logged telemetry value."""
    return statistics.fmean(logged(run_dir, f"telemetry/layer{i}/{quantity}")[-1] for i in (0, 1))


def report_rows(out):
    with open(out / "report.csv", newline="") as f:
        return {(r["backend"], r["setting"], r["task"]): r for r in csv.DictReader(f)}


def test_table_numbers_come_from_the_runs_metrics(runs):
    made, out = runs
    rows = report_rows(out)
    soft = rows[("softmax", "data.tokenizer=official", "ListOps")]
    rmfa = rows[("rmfa[exp]+ppSBN", "data.tokenizer=official", "ListOps")]
    seeds = [made["softmax1"], made["softmax2"]]
    acc = [100 * logged(d, "test/acc")[-1] for d in seeds]
    # Two seeds of different accuracy, so that a population std would not pass for a sample one.
    assert acc[0] != acc[1]
    assert soft["seeds"] == "2" and sorted(soft["seed_values"].split(";")) == ["1", "2"]
    assert float(soft["test_acc"]) == pytest.approx(statistics.fmean(acc))
    assert float(soft["test_acc_std"]) == pytest.approx(abs(acc[0] - acc[1]) / math.sqrt(2))
    soft_time = statistics.fmean(max(logged(d, "train/time_sec")) for d in seeds)
    soft_mem = statistics.fmean(max(logged(d, "train/peak_rss_mb")) for d in seeds)
    assert float(soft["time_sec"]) == pytest.approx(soft_time)
    assert float(soft["time_rel"]) == 1.0
    rmfa_time = max(logged(made["rmfa"], "train/time_sec"))
    assert rmfa["seeds"] == "1" and rmfa["test_acc_std"] == ""
    assert float(rmfa["test_acc"]) == pytest.approx(100 * logged(made["rmfa"], "test/acc")[-1])
    assert float(rmfa["time_rel"]) == pytest.approx(rmfa_time / soft_time)
    assert float(rmfa["softmax_time_sec"]) == pytest.approx(soft_time)
    rmfa_mem = max(logged(made["rmfa"], "train/peak_rss_mb"))
    assert float(rmfa["mem_rel"]) == pytest.approx(rmfa_mem / soft_mem)
    assert rmfa["device"] == "CPU" and rmfa["mem_kind"] == "RSS"
    nmse = statistics.fmean(last_nmse(d, "nmse") for d in seeds)
    assert float(soft["nmse"]) == pytest.approx(nmse)
    assert float(rmfa["nmse"]) == pytest.approx(last_nmse(made["rmfa"], "nmse"))
    assert float(rmfa["nmse_uniform"]) == pytest.approx(last_nmse(made["rmfa"], "nmse_uniform"))
    # Exact softmax is exact up to rounding; RMFA's random features are not.
    assert float(soft["nmse"]) < 1e-8 < float(rmfa["nmse"])
    md = (out / "report.md").read_text()
    std = statistics.stdev(acc)
    assert (
        f"| ListOps | softmax | data.tokenizer=official | 2 | {statistics.fmean(acc):.2f} ± "
        f"{std:.2f} | 1.00 ({soft_time:.3g} s) | 1.00 ({soft_mem:.0f} MB RSS) "
        f"| CPU ({soft['machine']}) | {soft['commit']} "
        f"| {nmse:.2e} | {float(soft['nmse_uniform']):.2e} | – |"
    ) in md
    assert soft["nmse_own"] == rmfa["nmse_own"] == ""  # both compute the kernel they stand for
    assert (
        f"| ListOps | rmfa[exp]+ppSBN | data.tokenizer=official | 1 | {float(rmfa['test_acc']):.2f}"
        f" | {rmfa_time / soft_time:.2f} | {rmfa_mem / soft_mem:.2f} (RSS) | CPU ("
    ) in md
    # The device names and commit come from the runs' provenance.yaml.
    assert soft["machine"].endswith(" thread") or soft["machine"].endswith(" threads")
    assert soft["commit"]
    assert "mean ± sample standard deviation (n−1)" in md


def test_other_data_settings_form_their_own_row(runs):
    made, out = runs
    rows = report_rows(out)
    sky = rows[("softmax", "data.tokenizer=skyformer", "ListOps")]
    assert sky["seeds"] == "1" and sky["runs"] == str(made["skyformer"])
    assert float(sky["test_acc"]) == pytest.approx(100 * logged(made["skyformer"], "test/acc")[-1])
    # Its own softmax reference, not the official-tokenizer runs'.
    assert float(sky["time_rel"]) == 1.0
    counted = [r for r in rows.values() if r["status"] == "run"]
    assert sorted(r["seeds"] for r in counted) == ["1", "1", "2"]


def test_unfinished_duplicate_and_junk_folders_are_listed_as_skipped(runs):
    made, out = runs
    md = (out / "report.md").read_text()
    skipped = md.split("## Skipped", 1)[1]
    runs_dir = made["softmax1"].parents[1]
    expected = {
        made["unfinished"]: "no test/acc in metrics.csv (an interrupted fit",
        made["stopped"]: "training stopped before its limit: tested at step 4 of "
        "trainer.max_steps 8",
        runs_dir / "junk": "not a run: no config.yaml or metrics.csv in it or below",
        runs_dir / "broken": "config.yaml is not valid YAML",
        # Same group and seed: the later folder in path order (softmax1/version_0) is kept.
        made["rerun"]: f"same seed as {made['softmax1']}, which is counted instead",
    }
    for path, reason in expected.items():
        assert f"- `{path}`: {reason}" in skipped
    assert skipped.count("\n- ") == len(expected)
    rows = report_rows(out)
    soft = rows[("softmax", "data.tokenizer=official", "ListOps")]
    assert soft["runs"].split(";") == [str(made["softmax1"]), str(made["softmax2"])]


def test_lra_reference_block_and_tasks_not_run(runs, tmp_path):
    made, out = runs
    md = (out / "report.md").read_text()
    for line in (
        "| Macformer paper | Transformer (softmax) | 37.30 |",
        "| Macformer paper | Macformer_exp (RMFA exp + ppSBN) | 38.36 |",
        "| SchoenbAt paper | SchoenbAt | 38.21 |",
        "| LRA paper | Transformer (softmax) | 36.37 |",
        "| xformers | Transformer, 2 layers, softmax | 37.50 |",
        "| ours | rmfa[exp]+ppSBN (trees 20–120 tokens, data.tokenizer=official, 1 seed) |",
        "| ours | softmax (trees 20–120 tokens, data.tokenizer=skyformer, 1 seed) |",
    ):
        assert line in md
    rows = list(csv.DictReader(open(out / "report.csv", newline="")))
    not_run = {r["task"]: r for r in rows if r["status"] == "not run"}
    assert list(not_run) == ["Text", "Retrieval", "Image", "Pathfinder"]
    assert not_run["Image"]["command"] == "python -m macformer_lit fit --config lra_image.yaml"
    assert not_run["Text"]["macformer_command"] == (
        "python -m macformer_lit fit --config lra_text.yaml --config attention/rmfa_exp.yaml"
    )
    assert "| Pathfinder | – | not run: `python -m macformer_lit fit --config lra_pathfinder" in md
    main([str(made["rmfa"]), "--out", str(tmp_path), "--lra_table", "off"])
    md = (tmp_path / "report.md").read_text()
    assert "not run" not in md and "Macformer paper" not in md
    assert "None." in md.split("## Skipped", 1)[1]


def test_plots_are_written(runs):
    _, out = runs
    for name in ("report.png", "curves.png", "telemetry.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name


def test_bands_draw_the_mean_and_the_min_max_over_runs():
    plt = pyplot()
    fig, ax = plt.subplots()
    curves = {
        "a": [[(0, 1.0), (2, 3.0)], [(0, 3.0), (2, 5.0)], [(0, 2.0)]],
        "b": [[(0, 10.0), (2, 10.0)]],
    }
    colours = colours_for(["a", "b"])
    plot_bands(ax, curves, colours=colours, linestyles={"b": "--"})
    a, b = ax.lines
    assert list(a.get_xdata()) == [0, 2] and list(a.get_ydata()) == [2.0, 4.0]
    assert a.get_label() == "a (n=3)" and a.get_color() == colours["a"]
    assert b.get_linestyle() == "--" and b.get_color() == colours["b"] != colours["a"]
    # One band, for the label with several runs: it spans their min and max at each x.
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == 1.0 and max(ys) == 5.0
    plt.close(fig)


@pytest.mark.parametrize("n", [3, 10, 14, 50, 73])
def test_no_two_labels_share_a_colour(n):
    """The mechanism screen has 14 methods: matplotlib's cycle of ten gave the 11th the 1st's
    colour. Up to ten labels keep the default colours."""
    from matplotlib.colors import to_hex

    colours = colours_for([f"m{i}" for i in range(n)])
    assert len(set(colours.values())) == n
    default = [to_hex(c) for c in pyplot().rcParams["axes.prop_cycle"].by_key()["color"]]
    assert [colours[f"m{i}"] for i in range(min(n, 10))] == default[: min(n, 10)]


def test_the_legend_sits_under_the_panels_with_each_label_once():
    """Legends inside the panels covered the curves once rows had long settings: one legend
    for the figure goes under every panel, and the figure grows by its height."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3), layout="constrained")
    curves = {f"setting {i} " + "x" * 60: [[(0, 1.0 * i), (1, 2.0 * i)]] for i in range(8)}
    colours = colours_for(list(curves))
    for ax in axes:
        plot_bands(ax, curves, colours=colours)
    legend_below(fig, axes, ncol=2)
    assert fig.get_figheight() > 3
    fig.canvas.draw()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"{k} (n=1)" for k in curves]
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for ax in axes:
        assert ax.get_legend() is None
        assert box.y1 <= ax.get_tightbbox(renderer).y0 + 1  # under the panel and its labels
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1  # inside the figure
    plt.close(fig)


def test_plot_names_shorten_the_attention_options_only():
    row = {
        "task": "ListOps",
        "backend": "rmfa[exp]+ppSBN",
        "setting": "data.tokenizer=official, model.attention.dropout=0.1, model.dropout=0.1",
        "device": "GPU",
    }
    assert row_name(row, 1) == (
        "rmfa[exp]+ppSBN [data.tokenizer=official, attention.dropout=0.1, model.dropout=0.1] (GPU)"
    )
    assert row_name(dict(row, setting="", device="CPU"), 2) == "ListOps: rmfa[exp]+ppSBN"


def test_report_without_runs_is_a_clear_error(tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(SystemExit, match="no finished runs") as err:
        main([str(tmp_path)])
    assert "not a run: no config.yaml or metrics.csv" in str(err.value.code)


def test_backend_labels():
    assert backend_label(None) == "softmax"
    assert backend_label({"name": "favor", "pre_sbn": True}) == "favor+preSBN"
    assert backend_label({"name": "rmfa", "kernel": "exp", "pre_sbn": 1, "post_sbn": 1}) == (
        "rmfa[exp]+ppSBN"
    )


def test_several_tasks_and_a_task_without_softmax(runs, tmp_path):
    """A Text run (IMDb reviews in the aclImdb layout) of linear attention only, reported
    with the ListOps runs: one row per task; the Text row has no softmax to compare with,
    so its time and memory ratios are empty rather than borrowed from ListOps' softmax."""
    made, _ = runs
    data = tmp_path / "imdb"
    for split in ("train", "test"):
        for label, text in (("pos", "A wonderful film, truly. " * 3), ("neg", "Dull. " * 9)):
            for i in range(4):
                folder = data / "aclImdb" / split / label
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{i}_7.txt").write_text(f"{text} {i}")
    (data / "aclImdb" / "train" / "unsup").mkdir()
    cli.main(
        ["fit", "--config", "lra_text.yaml", "--config", "attention/linear.yaml",
         "--data.data_dir", str(data), "--data.max_len", "96", "--data.batch_size", "4",
         "--model.init_args.d_model", "16", "--model.init_args.num_layers", "1",
         "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.accelerator", "cpu", "--trainer.devices", "1",
         "--trainer.enable_progress_bar", "false", "--wandb_mode", "disabled",
         "--runs_dir", str(tmp_path / "runs"), "--experiment", "text_linear"]
    )  # fmt: skip
    text_run = tmp_path / "runs/text_linear/version_0"
    out = tmp_path / "out"
    main([str(made["softmax1"]), str(made["rmfa"]), str(text_run), "--out", str(out)])
    rows = report_rows(out)
    assert sorted((k[2], k[0]) for k, r in rows.items() if r["status"] == "run") == [
        ("ListOps", "rmfa[exp]+ppSBN"),
        ("ListOps", "softmax"),
        ("Text", "linear"),
    ]
    text = next(r for k, r in rows.items() if k[2] == "Text" and r["status"] == "run")
    assert float(text["test_acc"]) == pytest.approx(100 * logged(text_run, "test/acc")[-1])
    assert text["time_rel"] == text["mem_rel"] == text["softmax_time_sec"] == ""
    assert float(text["time_sec"]) == pytest.approx(max(logged(text_run, "train/time_sec")))
    rmfa = next(r for k, r in rows.items() if k[0] == "rmfa[exp]+ppSBN")
    soft_time = max(logged(made["softmax1"], "train/time_sec"))
    rmfa_time = max(logged(made["rmfa"], "train/time_sec"))
    assert float(rmfa["time_rel"]) == pytest.approx(rmfa_time / soft_time)
    md = (out / "report.md").read_text()
    assert "| Text | linear |" in md
    # Text now has a run, so it is not among the tasks listed as not run.
    not_run = [r["task"] for r in rows.values() if r["status"] == "not run"]
    assert not_run == ["Retrieval", "Image", "Pathfinder"]


def test_runs_on_another_device_are_their_own_row_and_pool_in_the_papers_table(runs, tmp_path):
    """A GPU run (its metrics say train/peak_gpu_mem_mb) of the same config as CPU runs: its
    own row in the main table, timed against softmax on the GPU only, while the papers'
    table pools the accuracy of every seed whatever the device."""
    made, _ = runs
    root = tmp_path / "runs"
    for name in ("softmax1", "softmax2", "rmfa"):
        shutil.copytree(made[name], root / name)
    # softmax seed 3 and rmfa seed 1 again, "on a GPU": the memory column renamed, times halved.
    for name, src, seed in (("softmax3_gpu", "softmax1", 3), ("rmfa_gpu", "rmfa", 1)):
        shutil.copytree(made[src], root / name)
        config = root / name / "config.yaml"
        text = config.read_text()
        assert "seed_everything: 1\n" in text
        config.write_text(text.replace("seed_everything: 1\n", f"seed_everything: {seed}\n"))
        metrics = root / name / "metrics.csv"
        with open(metrics, newline="") as f:
            table = list(csv.DictReader(f))
        for r in table:
            if r.get("train/time_sec"):
                r["train/time_sec"] = str(float(r["train/time_sec"]) / 2)
            r["train/peak_gpu_mem_mb"] = r.pop("train/peak_rss_mb")
        with open(metrics, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    out = tmp_path / "out"
    main([str(root), "--out", str(out)])
    with open(out / "report.csv", newline="") as f:
        rows = {(r["backend"], r["device"]): r for r in csv.DictReader(f) if r["status"] == "run"}
    assert set(rows) == {
        ("softmax", "CPU"),
        ("softmax", "GPU"),
        ("rmfa[exp]+ppSBN", "CPU"),
        ("rmfa[exp]+ppSBN", "GPU"),
    }
    assert rows[("softmax", "CPU")]["seeds"] == "2" and rows[("softmax", "GPU")]["seeds"] == "1"
    gpu_soft = max(logged(made["softmax1"], "train/time_sec")) / 2
    gpu_rmfa = max(logged(made["rmfa"], "train/time_sec")) / 2
    assert float(rows[("softmax", "GPU")]["time_sec"]) == pytest.approx(gpu_soft)
    assert float(rows[("rmfa[exp]+ppSBN", "GPU")]["time_rel"]) == pytest.approx(gpu_rmfa / gpu_soft)
    assert rows[("rmfa[exp]+ppSBN", "GPU")]["mem_kind"] == "GPU"
    cpu_soft = statistics.fmean(
        max(logged(made[n], "train/time_sec")) for n in ("softmax1", "softmax2")
    )
    assert float(rows[("rmfa[exp]+ppSBN", "CPU")]["time_rel"]) == pytest.approx(
        max(logged(made["rmfa"], "train/time_sec")) / cpu_soft
    )
    accs = [100 * logged(made[n], "test/acc")[-1] for n in ("softmax1", "softmax2", "softmax1")]
    md = (out / "report.md").read_text()
    pooled = f"{statistics.fmean(accs):.2f} ± {statistics.stdev(accs):.2f}"
    assert (
        f"| ours | softmax (trees 20–120 tokens, 3 seeds: 2 on CPU + 1 on GPU) | {pooled} |" in md
    )
    rmfa_accs = [100 * logged(made["rmfa"], "test/acc")[-1]] * 2
    assert f"2 seeds: 1 on CPU + 1 on GPU) | {statistics.fmean(rmfa_accs):.2f} ± 0.00 |" in md


def test_curves_draw_the_validation_majority_class_and_share_colours(runs, monkeypatch):
    """Each run logs its validation split's majority-class share; the curves draw it as one
    line, and a row keeps its colour in every figure of the report."""
    made, _ = runs
    share = logged(made["softmax1"], "val/majority_acc")[-1]
    assert 0 < share < 1
    from matplotlib.figure import Figure

    from macformer_lit import report

    figures = {}
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, path, **kw: figures.__setitem__(path.name, fig)
    )
    run_list, _ = report.collect([made["softmax1"].parent], made["softmax1"].parents[1] / "x")
    rows, groups = report.summarise(run_list)
    report.plot_validation(rows, groups, made["softmax1"].parent / "curves.png")
    report.plot_telemetry(rows, groups, made["softmax1"].parent / "telemetry.png")
    (ax,) = figures["curves.png"].axes
    majority = [ln for ln in ax.lines if ln.get_label() == "majority class (validation)"]
    assert len(majority) == 1 and list(majority[0].get_ydata()) == [100 * share] * 2
    colour_of = {}
    for fig in figures.values():
        for line in fig.axes[0].lines:
            label = line.get_label().rsplit(" (n=", 1)[0]
            if not label.startswith("_") and label != "majority class (validation)":
                colour_of.setdefault(label, set()).add(line.get_color())
    assert colour_of and all(len(c) == 1 for c in colour_of.values())


def test_own_kernel_nmse_is_read_where_logged():
    """A degree-2 Maclaurin run logs its NMSE against the kernel it computes exactly: the
    report takes each layer's last value, averaged over layers, beside uniform's."""
    rows = [
        {"step": "10", "telemetry/layer0/nmse": "0.5", "telemetry/layer0/nmse_own": "1e-5",
         "telemetry/layer0/nmse_uniform_own": "0.3", "telemetry/layer1/nmse_own": "3e-5",
         "telemetry/layer1/nmse_uniform_own": "0.5"},
        {"step": "20", "telemetry/layer0/nmse": "0.6", "telemetry/layer0/nmse_own": "2e-5",
         "telemetry/layer0/nmse_uniform_own": "0.4", "telemetry/layer1/nmse_own": "4e-5",
         "telemetry/layer1/nmse_uniform_own": "0.6"},
    ]  # fmt: skip
    series, final = report._telemetry(rows)
    assert final["nmse_own"] == pytest.approx(3e-5)
    assert final["nmse_uniform_own"] == pytest.approx(0.5)
    assert series["nmse_own"] == [(10.0, pytest.approx(2e-5)), (20.0, pytest.approx(3e-5))]
    row = {"nmse_own": final["nmse_own"], "nmse_uniform_own": final["nmse_uniform_own"]}
    assert report._own(row) == "3.00e-05 / 5.00e-01"
