"""A key given twice in any YAML the program reads is refused, naming the file and line.

YAML keeps the last of two equal keys silently: a sweep file with the label ``"0"`` twice
ran the point labelled ``seed=0`` with the second one's seed. Each reader is tried: the
sweep file, ``--config`` files, inline YAML on the command line, and the ``config.yaml`` that
``report`` reads back.
"""

from pathlib import Path

import pytest
import yaml

from macformer_lit import sweep, yamlio
from macformer_lit.cli import main
from macformer_lit.report import Skip, read_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, line",
    [
        ("a: 1\nb:\n  c: 1\n  c: 2\n", 4),  # nested
        ("runs:\n  - {x: 1}\n  - name: a\n    name: b\n", 4),  # inside a list
        ("seed:\n  0: {seed_everything: 0}\n  0: {seed_everything: 1}\n", 3),
    ],
)
def test_the_second_key_is_named_with_its_line(text, line):
    with pytest.raises(yamlio.DuplicateKeyError) as err:
        yamlio.load(text)
    assert yaml.safe_load(text)  # what YAML does: the last one wins, silently
    message = yamlio.describe(err.value, "f.yaml")
    assert message.startswith(f"f.yaml, line {line}: key ") and "given twice" in message


def test_merged_keys_may_be_overridden_and_a_quoted_key_is_another_key():
    merged = "base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  x: 3\n"
    assert yamlio.load(merged)["run"] == {"x": 3, "y": 2}
    assert yamlio.load('"0": a\n0: b\n') == {"0": "a", 0: "b"}


def test_inline_yaml_names_the_column():
    with pytest.raises(yamlio.DuplicateKeyError) as err:
        yamlio.load("{name: softmax, name: rmfa}")
    assert "line 1, column 17: key 'name'" in yamlio.describe(err.value, "value")


def sweep_file(tmp_path, seed_block: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nconfig: translation_synthetic.yaml\naxes:\n  seed:\n{seed_block}")
    return path


def test_a_sweep_label_given_twice_is_refused_before_anything_runs(tmp_path, capsys):
    path = sweep_file(tmp_path, '    "0": {seed_everything: 0}\n    "0": {seed_everything: 1}\n')
    with pytest.raises(SystemExit) as err:
        main(["sweep", str(path), "--runs_dir", str(tmp_path / "runs")])
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"sweep config {path}, line 6: key '0' is given twice" in line, line
    assert "first at line 5" in line
    assert not (tmp_path / "runs").exists()


def test_a_label_written_once_quoted_once_not_is_one_label(tmp_path):
    path = sweep_file(tmp_path, '    0: {seed_everything: 0}\n    "0": {seed_everything: 1}\n')
    with pytest.raises(sweep.SweepError, match="axis 'seed' has the label '0' twice"):
        sweep.load_sweep(path)


TINY = ["--config", "lra_listops.yaml", "--trainer.accelerator", "cpu", "--wandb_mode", "disabled"]


def refused_line(capsys, argv, root: Path) -> str:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("macformer_lit: error: "), line
    assert not (root / "runs").exists()  # refused before any run folder
    return line


def test_a_config_file_with_a_key_twice(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 4\nseed_everything: 1\ntrainer:\n  max_steps: 8\n")
    argv = ["fit", *TINY, "--config", str(bad), "--runs_dir", str(tmp_path / "runs")]
    line = refused_line(capsys, argv, tmp_path)
    assert f"config {bad}, line 4: key 'trainer' is given twice" in line, line


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_inline_yaml_with_a_key_twice(tmp_path, capsys, subcommand):
    """jsonargparse took such a value for a string (an attention spec may be a bare name)."""
    value = "{name: softmax, name: rmfa}"
    argv = [subcommand, *TINY, "--model.init_args.attention", value]
    line = refused_line(capsys, [*argv, "--runs_dir", str(tmp_path / "runs")], tmp_path)
    assert f"YAML value {value!r}, line 1, column 17: key 'name' is given twice" in line, line


def test_report_skips_a_config_yaml_with_a_key_twice(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {}\ndata: {}\nmodel: {}\n")
    with pytest.raises(Skip, match="config.yaml, line 3: key 'model' is given twice"):
        read_config(tmp_path)
