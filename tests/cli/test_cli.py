"""The real LightningCLI: config lookup, composition, links, every shipped YAML, a tiny fit."""

import csv
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import tiny_listops

from macformer_lit.attention import AttentionBackend, Kernel, build_attention
from macformer_lit.attention.spec import constructor_chain
from macformer_lit.callbacks.preemption import AtomicCheckpointIO
from macformer_lit.cli import (
    CONFIG_DIR,
    LINKED,
    ConfigNotFound,
    MacformerCLI,
    main,
    resolve_config,
    resolve_config_args,
)

REPO = Path(__file__).resolve().parents[2]
TOP_CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
ATTENTION_CONFIGS = sorted(p.name for p in (CONFIG_DIR / "attention").glob("*.yaml"))


def tiny_listops_args(tmp_path, *extra):
    return tiny_listops(tmp_path / "data", tmp_path / "runs", *extra)


def test_bare_config_name_resolves_to_shipped_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_config("lra_listops.yaml")) == CONFIG_DIR / "lra_listops.yaml"
    assert Path(resolve_config("lra_listops")) == CONFIG_DIR / "lra_listops.yaml"
    # A file in the current directory wins over the shipped one.
    (tmp_path / "lra_listops.yaml").write_text("seed_everything: 1\n")
    assert resolve_config("lra_listops.yaml") == "lra_listops.yaml"


def test_renamed_config_says_what_to_write_instead():
    with pytest.raises(ConfigNotFound) as err:
        resolve_config("lra_listops_cpu.yaml")
    assert "'lra_listops_cpu.yaml' was renamed: use listops_short_cpu.yaml" in str(err.value.code)
    assert Path(resolve_config("listops_short_cpu.yaml")).is_file()


def test_unknown_config_name_lists_shipped_ones():
    with pytest.raises(SystemExit) as err:
        resolve_config("lra_lisops.yaml")
    assert "config 'lra_lisops.yaml' is neither a file nor a config shipped" in str(err.value.code)
    assert "lra_listops.yaml" in str(err.value.code)


def test_config_args_rewritten_and_experiment_named_from_stems():
    argv, stems = resolve_config_args(["fit", "-c", "lra_listops.yaml", "--config=lra_listops"])
    assert argv[1:] == [
        "-c",
        str(CONFIG_DIR / "lra_listops.yaml"),
        "--config",
        str(CONFIG_DIR / "lra_listops.yaml"),
    ]
    assert stems == ["lra_listops", "lra_listops"]


def test_unknown_config_from_command_line_is_one_clear_message():
    proc = subprocess.run(
        [sys.executable, "-m", "macformer_lit", "fit", "--config", "nope.yaml"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert "config 'nope.yaml' is neither a file nor a config shipped" in proc.stderr
    assert "Traceback" not in proc.stderr


def write_multi30k(folder: Path) -> None:
    """Tiny raw Multi30K files (the Multi30K DataModule trains its tokenizer at init)."""
    folder.mkdir(parents=True, exist_ok=True)
    en = ["A man rides a horse.", "Two dogs play in the snow.", "A girl reads a book."]
    de = ["Ein Mann reitet ein Pferd.", "Zwei Hunde spielen im Schnee.", "Ein Mädchen liest."]
    for split in ("train", "val", "test_2016_flickr"):
        (folder / f"{split}.en").write_text("\n".join(en) + "\n")
        (folder / f"{split}.de").write_text("\n".join(de) + "\n")


@pytest.mark.parametrize("name", TOP_CONFIGS)
def test_every_task_config_parses_and_instantiates(name, tmp_path):
    if name.startswith("multi30k"):
        write_multi30k(tmp_path / "data")
    cli = MacformerCLI(
        [
            "--config",
            name,
            "--runs_dir",
            str(tmp_path),
            "--wandb_mode",
            "disabled",
            "--data.data_dir",
            str(tmp_path / "data"),
            "--trainer.accelerator",
            "cpu",
        ],
        run=False,
    )
    # The task each config builds is known from its name (asserted, so both kinds of link
    # below are exercised), and the DataModule's facts reach the model through the CLI
    # links: every one, for each task.
    task = "LitTranslator" if name in TRANSLATION_CONFIGS else "LitClassifier"
    assert type(cli.model).__name__ == task
    for key in LINKED_FACTS[task]:
        assert cli.model.hparams[key] == getattr(cli.datamodule, key), key


TRANSLATION_CONFIGS = ("multi30k.yaml", "translation_synthetic.yaml")
LINKED_FACTS = {
    "LitTranslator": ("vocab_size", "max_len", "pad_id", "bos_id", "eos_id"),
    "LitClassifier": ("vocab_size", "max_len", "pad_id", "num_classes"),
}


def test_the_link_lists_cover_every_cli_link_and_every_translation_config():
    assert set(LINKED_FACTS["LitTranslator"]) | set(LINKED_FACTS["LitClassifier"]) == set(LINKED)
    assert set(TRANSLATION_CONFIGS) < set(TOP_CONFIGS)


@pytest.mark.parametrize("name", ATTENTION_CONFIGS)
def test_every_attention_config_composes_with_a_task(name, tmp_path):
    cli = MacformerCLI(
        tiny_listops_args(tmp_path, "--config", f"attention/{name}", "--wandb_mode", "disabled"),
        run=False,
    )
    spec = cli.model.hparams["attention"]
    # The backend is the file name's first word (rmfa_exp_h01 -> rmfa), and every setting in
    # the file reaches the saved hyperparameters unchanged.
    assert spec["name"] == name.split(".")[0].split("_")[0]
    shipped = yaml.safe_load((CONFIG_DIR / "attention" / name).read_text())["model"]["attention"]
    assert {key: spec[key] for key in shipped} == shipped
    # The hyperparameters are the CLI's config dump (LightningCLI hands them to
    # save_hyperparameters), not what the model was built with: the layers themselves must
    # equal the backend built directly from the file, every setting of it.
    hp = cli.model.hparams
    options = {key: value for key, value in shipped.items() if key != "name"}
    expected = build_attention(
        shipped["name"], head_dim=hp.d_model // hp.num_heads, num_heads=hp.num_heads, **options
    )
    layers = [m for m in cli.model.modules() if isinstance(m, AttentionBackend)]
    want = [backend_settings(m) for m in expected.modules() if isinstance(m, AttentionBackend)]
    # Every option of the file is among the settings compared.
    compared = {key for _, settings in want for key in settings}
    assert set(options) <= compared
    assert len(layers) == hp.num_layers * len(want)
    for i in range(hp.num_layers):
        assert [backend_settings(m) for m in layers[i * len(want) : (i + 1) * len(want)]] == want


def backend_settings(module):
    """A backend's class and the value of every constructor argument it keeps (kernel by
    name); nothing drawn at random."""
    params = [
        n for init in constructor_chain(type(module)) for n in inspect.signature(init).parameters
    ]
    settings = {
        name: getattr(module, name)
        for name in params
        if name not in ("self", "inner") and hasattr(module, name)
    }
    return type(module).__name__, {
        key: value.name if isinstance(value, Kernel) else value for key, value in settings.items()
    }


def test_dotted_override_and_links(tmp_path):
    cli = MacformerCLI(
        tiny_listops_args(
            tmp_path,
            "--trainer.max_steps",
            "20",
            "--model.init_args.d_model",
            "32",
            "--data.tokenizer",
            "skyformer",
            "--wandb_mode",
            "disabled",
        ),
        run=False,
    )
    assert cli.trainer.max_steps == 20
    assert cli.model.hparams.d_model == 32
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size == 15
    assert cli.model.hparams.num_classes == 10


def test_print_config_works(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "macformer_lit",
            "fit",
            "--config",
            "lra_listops.yaml",
            "--trainer.max_steps",
            "7",
            "--print_config",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 7" in proc.stdout
    assert "class_path: macformer_lit.tasks.LitClassifier" in proc.stdout


def test_tiny_fit_leaves_wandb_run_csv_and_checkpoints(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_API_KEY": ""}
    env.pop("WANDB_API_KEY")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "macformer_lit",
            "fit",
            *tiny_listops_args(
                tmp_path,
                "--trainer.max_steps",
                "3",
                "--trainer.val_check_interval",
                "3",
                "--trainer.log_every_n_steps",
                "1",
                "--experiment",
                "tiny",
                "--trainer.enable_progress_bar",
                "false",
            ),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "tiny" / "version_0"
    assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    # One training row per step (log_every_n_steps 1, max_steps 3) and one test row.
    assert sum(bool(r.get("train/loss_step")) for r in rows) == 3
    assert sum(bool(r.get("test/acc")) for r in rows) == 1
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert "max_steps: 3" in (run / "config.yaml").read_text()
    # The dropout mask generator is part of what a replay needs.
    assert "dropout_masks: fast" in (run / "config.yaml").read_text()
    assert "test/acc = " in proc.stdout and "majority-class baseline" in proc.stdout
    assert "wandb sync" in proc.stdout

    # --ckpt_path last continues the same run folder; earlier metrics survive.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "macformer_lit",
            "fit",
            *tiny_listops_args(
                tmp_path,
                "--trainer.max_steps",
                "5",
                "--trainer.val_check_interval",
                "2",
                "--trainer.log_every_n_steps",
                "1",
                "--experiment",
                "tiny",
                "--trainer.enable_progress_bar",
                "false",
                "--ckpt_path",
                "last",
                "--test_after_fit",
                "false",
            ),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "runs" / "tiny" / "version_1").exists()
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    # 3 steps before the restart and 2 after it, all in one file.
    assert sum(bool(r.get("train/loss_step")) for r in rows) == 5


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--model.init_args.attention", "{name: nope}"],
            "unknown attention backend 'nope'; valid backends: favor, kernelized, linear, "
            "maclaurin, rmfa",
        ),
        (
            [
                "--config",
                "attention/rmfa_exp.yaml",
                "--model.init_args.attention.num_features",
                "0",
            ],
            "num_features must be >= 1; got 0",
        ),
        (["--model.init_args.attention", "{name: rmfa, kernel: inv}"], "enable pre_sbn: true"),
        (
            ["--config", "attention/rmfa_exp.yaml", "--model.init_args.attention.measure", "x"],
            "model.init_args.attention: option measure='x' of attention backend 'rmfa' must be "
            "one of: 'faithful', 'official', 'h01'",
        ),
        (
            ["--config", "attention/rmfa_exp.yaml", "--model.init_args.attention.kernel", "expo"],
            "model.init_args.attention: unknown kernel 'expo'; valid kernels: exp, inv, log, sqrt",
        ),
        (
            ["--model.init_args.attention", "{name: favor, num_features: many}"],
            "option num_features='many' of attention backend 'favor' must be int",
        ),
        (
            ["--model.init_args.attention", "{name: rmfa, pre_sbn: true, sbn_stats: col}"],
            "option sbn_stats='col' of attention backend 'rmfa' must be one of: 'batch', 'row'",
        ),
        (
            ["--model.init_args.num_heads", "3"],
            "model.init_args.d_model=64 is not divisible by num_heads=3",
        ),
        (["--data.train_size", "0"], "train_size must be a positive integer; got 0"),
    ],
)
def test_bad_values_get_one_clear_message(extra, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["fit", *tiny_listops_args(tmp_path, "--wandb_mode", "disabled", *extra)])
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    assert message in stderr
    assert "Traceback" not in stderr and "Union subtypes" not in stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trainer.strategy", "ddpp"], "invalid strategy name: `strategy='ddpp'`"),
        (["--trainer.accelerator", "gpu"], "use --trainer.accelerator cpu or auto"),
        (["--trainer.devices", "0"], "`Trainer(devices='0')` value is not a valid input"),
    ],
)
def test_bad_trainer_settings_get_one_line_and_leave_no_folder(extra, message, tmp_path, capsys):
    if "gpu" in extra and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as err:
        main(["fit", *tiny_listops_args(tmp_path, "--wandb_mode", "offline", *extra)])
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    assert "macformer_lit: error: invalid trainer settings: " in stderr and message in stderr
    assert "Traceback" not in stderr
    assert not list((tmp_path / "runs").glob("*/version_*"))


def test_attention_is_checked_at_parse_time_before_data_or_model(tmp_path, capsys):
    """A bad decoder cross-attention spec is reported although the data is missing too:
    the attention check runs before the DataModule (and the model) are built."""
    with pytest.raises(SystemExit) as err:
        main(
            [
                "fit",
                "--config",
                "multi30k.yaml",
                "--data.data_dir",
                str(tmp_path / "none"),
                "--runs_dir",
                str(tmp_path / "runs"),
                "--wandb_mode",
                "disabled",
                "--model.init_args.cross_attention",
                "{name: rmfa, denominator: clip}",
            ]
        )
    assert err.value.code == 2
    stderr = capsys.readouterr().err
    assert (
        "macformer_lit: error: model.init_args.cross_attention: option denominator='clip' of "
        "attention backend 'rmfa' must be one of: 'fallback', 'clamp', 'abs', 'none'" in stderr
    )
    assert "missing file" not in stderr and "Traceback" not in stderr
    assert not (tmp_path / "none").exists()


def test_missing_data_names_the_files_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--config",
                "multi30k.yaml",
                "--data.data_dir",
                str(tmp_path / "none"),
                "--runs_dir",
                str(tmp_path / "runs"),
                "--wandb_mode",
                "disabled",
            ]
        )
    stderr = capsys.readouterr().err
    assert "macformer_lit: error: Multi30K en→de: missing file(s)" in stderr
    assert "Traceback" not in stderr
    assert "train.en" in stderr and "github.com/multi30k/dataset" in stderr


def test_incompatible_checkpoint_names_the_difference(tmp_path, capsys):
    main(
        [
            "fit",
            *tiny_listops_args(
                tmp_path,
                "--trainer.max_steps",
                "1",
                "--wandb_mode",
                "disabled",
                "--experiment",
                "a",
                "--test_after_fit",
                "false",
                "--trainer.enable_progress_bar",
                "false",
            ),
        ]
    )
    ckpt = tmp_path / "runs/a/version_0/checkpoints/last.ckpt"
    assert ckpt.is_file()
    with pytest.raises(SystemExit):
        # The skyformer tokeniser has 15 ids, the checkpoint's vocabulary 16.
        main(
            [
                "test",
                *tiny_listops_args(
                    tmp_path,
                    "--data.tokenizer",
                    "skyformer",
                    "--wandb_mode",
                    "disabled",
                    "--ckpt_path",
                    str(ckpt),
                ),
            ]
        )
    stderr = capsys.readouterr().err
    assert "this checkpoint does not fit the model of this run" in stderr
    assert "vocab_size: checkpoint has 16, this run 15" in stderr


def test_checkpoint_writes_stay_atomic_beside_a_precision_plugin(tmp_path):
    plugin = tmp_path / "fp16_cpu.yaml"
    plugin.write_text(
        "trainer:\n  plugins:\n"
        "    - class_path: lightning.pytorch.plugins.precision.MixedPrecision\n"
        "      init_args: {precision: 16-mixed, device: cpu}\n"
    )
    cli = MacformerCLI(
        tiny_listops_args(tmp_path, "--config", str(plugin), "--wandb_mode", "disabled"),
        run=False,
    )
    assert type(cli.trainer.precision_plugin).__name__ == "MixedPrecision"
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_without_examples_is_named_in_one_line(tmp_path, capsys, split):
    folder = tmp_path / "data" / "listops-1000"
    folder.mkdir(parents=True)
    row = "( [MAX 2 9 ] )\t9\n"
    # Exactly the sizes asked for (16 / 8 / 8), so nothing else is logged.
    for name, count in (("train", 16), ("val", 8), ("test", 8)):
        rows = "" if name == split else row * count
        (folder / f"basic_{name}.tsv").write_text("Source\tTarget\n" + rows)
    with pytest.raises(SystemExit):
        main(["fit", *tiny_listops_args(tmp_path, "--wandb_mode", "disabled")])
    stderr = capsys.readouterr().err
    assert f"basic_{split}.tsv: the {split} split holds no examples" in stderr
    assert "Traceback" not in stderr
    assert not list((tmp_path / "runs").glob("*/version_*/checkpoints/*.ckpt"))
