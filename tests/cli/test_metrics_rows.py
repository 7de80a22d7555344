"""RunCSVLogger keeps metrics.csv in step with checkpoints (the end-to-end case, SIGKILL
and resume, is tests/distributed/test_resume_sigkill.py)."""

import csv

from macformer_lit.loggers import RunCSVLogger


def _rows(logger):
    with open(logger.metrics_path, newline="") as f:
        return [(int(r["step"]), r["train/loss"], r["val/acc"]) for r in csv.DictReader(f)]


def test_rows_after_the_checkpoint_at_its_step_or_later_are_dropped(tmp_path):
    logger = RunCSVLogger(str(tmp_path))
    for step in range(3):
        logger.log_metrics({"train/loss": float(step)}, step=step)
    logger.log_metrics({"val/acc": 0.5}, step=3)
    assert logger.rows_on_disk() == 4  # pending rows are written first
    # After the checkpoint (saved at global step 3 by a batch-end callback): the row of
    # the batch that made step 3 (logged at 2), then steps the resumed run will redo.
    logger.log_metrics({"train/loss": 2.5}, step=2)
    logger.log_metrics({"train/loss": 3.0}, step=3)
    logger.log_metrics({"train/loss": 4.0}, step=4)
    logger.save()
    assert logger.drop_rows_after(4, step=3) == 2
    assert _rows(logger) == [
        (0, "0.0", ""),
        (1, "1.0", ""),
        (2, "2.0", ""),
        (3, "", "0.5"),  # before the checkpoint: kept although at its step
        (2, "2.5", ""),
    ]
    # Nothing past the count: nothing to drop; a run folder without metrics.csv: none.
    assert logger.drop_rows_after(5, step=0) == 0
    assert RunCSVLogger(str(tmp_path / "new")).drop_rows_after(0, step=0) == 0
