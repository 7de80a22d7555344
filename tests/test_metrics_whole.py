"""metrics.csv rows are written whole, and a row that is not whole is refused where it is
read, naming the file and line. A row cut inside a value still parses: ``report`` over a run
whose last row was cut from 0.0625 to 0.06 reported 6.00 % where the run had 6.25 %, and
listed nothing as skipped."""

import errno
import logging
import os

import pytest

from macformer_lit import metrics_file, report
from macformer_lit.loggers import RunCSVLogger
from macformer_lit.metrics_file import MetricsFileError, read_metrics_rows

CONFIG = """seed_everything: {seed}
trainer: {{max_steps: 4}}
model:
  class_path: macformer_lit.tasks.classifier.LitClassifier
  init_args: {{attention: {{name: softmax}}}}
data:
  class_path: macformer_lit.data.listops.ListOpsDataModule
  init_args: {{seed: 0}}
"""
METRICS = "epoch,step,test/acc,train/loss_step\r\n0,3,,1.25\r\n0,4,{acc},\r\n"


def make_run(folder, seed, acc):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(CONFIG.format(seed=seed))
    (folder / "metrics.csv").write_text(METRICS.format(acc=acc), newline="")
    return folder


def test_report_skips_a_run_whose_last_row_is_cut_inside_a_value(tmp_path):
    make_run(tmp_path / "seed0", 0, "0.5")
    cut = make_run(tmp_path / "seed1", 1, "0.0625")
    text = (cut / "metrics.csv").read_bytes()
    (cut / "metrics.csv").write_bytes(text[: text.index(b"0.0625") + 4])  # "0,4,0.06"
    runs, skipped = report.collect([tmp_path])
    assert [r.test_acc for r in runs] == [0.5]
    (folder, why), *_ = [s for s in skipped if s[0] == cut]
    assert why.startswith(f"{cut / 'metrics.csv'}, line 3: the file ends inside this row"), why


@pytest.mark.parametrize(
    "text, line",
    [
        ("step,a,b\n1,2,3\n2,3\n3,4,5\n", 3),  # a short row in the middle
        ("step,a,b\n1,2,3\n2,3,4,1,5,6\n", 3),  # two rows run together
    ],
)
def test_a_row_of_the_wrong_length_names_its_line(tmp_path, text, line):
    path = tmp_path / "metrics.csv"
    path.write_text(text)
    with pytest.raises(MetricsFileError, match=f"metrics.csv, line {line}: "):
        read_metrics_rows(path)


def logger_with_rows(folder, *rows):
    lg = RunCSVLogger(str(folder))
    for step, metrics in rows:
        lg.log_metrics(metrics, step=step)
    lg.save()
    return lg


def test_rows_are_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    lg = logger_with_rows(tmp_path, (0, {"loss": 2.0}), (1, {"loss": 1.5}))
    path = tmp_path / "metrics.csv"
    before = path.read_bytes()
    real_write = os.write

    def disk_fills(fd, data):  # half the rows go out, then the disk is full
        if len(data) > 4:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    lg.log_metrics({"loss": 1.25}, step=2)
    lg.log_metrics({"loss": 1.0}, step=3)
    monkeypatch.setattr(metrics_file.os, "write", disk_fills)
    with pytest.raises(OSError):
        lg.save()
    assert path.read_bytes() == before  # cut back: no half row
    monkeypatch.undo()
    lg.log_metrics({"loss": 0.5, "acc": 0.75}, step=4)  # a new column: the file is replaced
    lg.save()
    rows = read_metrics_rows(path)
    # The rows the full disk refused were kept, and written whole with the next ones.
    assert [(r["step"], r["loss"], r["acc"]) for r in rows] == [
        ("0", "2.0", ""),
        ("1", "1.5", ""),
        ("2", "1.25", ""),
        ("3", "1.0", ""),
        ("4", "0.5", "0.75"),
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary


def test_a_resume_drops_a_row_its_file_ends_inside_before_appending(tmp_path, caplog):
    logger_with_rows(tmp_path, (0, {"loss": 2.0}), (1, {"loss": 1.5}))
    path = tmp_path / "metrics.csv"
    path.write_bytes(path.read_bytes()[:-3])  # killed while writing the last row
    with caplog.at_level(logging.WARNING, logger="macformer_lit.loggers"):
        logger_with_rows(tmp_path, (2, {"loss": 1.25}))
    assert f"{path}, line 3: dropped a row the file ended inside" in caplog.text
    rows = read_metrics_rows(path)
    assert [(r["step"], r["loss"]) for r in rows] == [("0", "2.0"), ("2", "1.25")]
