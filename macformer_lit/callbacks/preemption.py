"""Checkpoints that survive kills: atomic writes, and a save on SIGTERM.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the same folder and
renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save
leaves the previous checkpoint intact. ``SaveOnSigterm`` answers a SIGTERM (what SLURM
and most clusters send before pre-emption; Lightning turns it into ``SIGTERMException``
at the next batch boundary), and a first Ctrl-C or a SIGHUP the same way, by writing
``last.ckpt`` where ModelCheckpoint keeps it and printing the command that resumes from that
step; a validation it interrupts runs again on resume.
``MetricsRowsCheckpoint`` keeps ``metrics.csv`` in step with the checkpoints: a run killed
some steps after its last checkpoint has already written those steps' rows, and the
resumed run logs them again. ``EpochAccumulatorsCheckpoint`` carries the interrupted
epoch's training averages (``train/loss_epoch``, ``train/acc``, ``train/ppl``) across the
resume, which Lightning does not keep in a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import sys
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.evaluation_loop import RestartStage as _EvalRestartStage
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric
from torchmetrics.utilities.data import (
    dim_zero_cat,
    dim_zero_max,
    dim_zero_mean,
    dim_zero_min,
    dim_zero_sum,
)

from macformer_lit import interrupts
from macformer_lit.metrics_file import MetricsFileError, read_metrics_rows

_MID_EVALUATION = _EvalRestartStage.RESTARTED_MID_EVALUATION


class MetricsRowsCheckpoint(L.Callback):
    """Record in each checkpoint how many rows ``metrics.csv`` held when it was saved; on
    resume, drop the rows logged after it at the checkpoint's global step or later (the
    resumed run logs those steps again), so the file ends up as that of a run never
    interrupted. (A validation logged after a checkpoint saved at the end of a training
    batch, at that same step, counts as after it.)"""

    KEY = "metrics_csv_rows"

    @staticmethod
    def _csv_loggers(trainer):
        from macformer_lit.loggers import RunCSVLogger

        return [lg for lg in trainer.loggers if isinstance(lg, RunCSVLogger)]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        loggers = self._csv_loggers(trainer)
        if trainer.is_global_zero and loggers:
            checkpoint[self.KEY] = loggers[0].rows_on_disk()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        rows = checkpoint.get(self.KEY)
        if rows is None or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        step = int(checkpoint.get("global_step", 0))
        for lg in self._csv_loggers(trainer):
            dropped = lg.drop_rows_after(rows, step)
            if dropped:
                rank_zero_info(
                    f"{lg.metrics_path}: dropped {dropped} row(s) logged after the checkpoint "
                    f"at step {step}; those steps run again"
                )


# A torchmetrics state's reduction over ranks, by name.
_STATE_REDUCTIONS = {
    dim_zero_sum: "sum",
    dim_zero_cat: "cat",
    dim_zero_max: "max",
    dim_zero_min: "min",
    dim_zero_mean: "mean",
}


def _reduction(meta) -> str:
    for name in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{name}_reduction"):
            return name
    return "other"


def _gather(trainer, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from every rank, stacked (world, ...); a collective under DDP."""
    dist = torch.distributed
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    gathered = trainer.strategy.all_gather(tensor.to(trainer.strategy.root_device))
    return gathered.reshape(trainer.world_size, *tensor.shape).cpu()


class EpochAccumulatorsCheckpoint(L.Callback):
    """The training epoch's running averages in a checkpoint saved inside that epoch, so
    that its ``train/loss_epoch``, ``train/acc``, ``train/ppl`` after a resume are those of
    a run never stopped.

    What ``self.log(..., on_epoch=True)`` has summed so far lives in the training loop's
    ``_ResultCollection``, and a logged torchmetrics ``Metric`` keeps its own states (not
    persistent): Lightning puts neither in a checkpoint, so a resumed epoch used to average
    its resumed batches only, and an epoch resumed at its very end (a stop in its closing
    validation) logged nothing.

    Saving (on every rank: a collective): for each epoch-level entry of the training
    results, a tensor entry's sum and count on every rank, and a Metric's states reduced
    over ranks with its own ``dist_reduce_fx`` (the whole global batch so far). Only a
    checkpoint inside an epoch (begun, its end not yet processed) gets them.

    Resuming with batches left in the epoch: the Metric states go back before the first
    batch, sum and cat states on rank 0 only (zero elsewhere: the epoch end's sync counts
    every example once), max, min and mean states on every rank; each rank adds its own
    tensor sums and counts to the live ones once Lightning has reset those for the resumed
    epoch (at the second batch, or the epoch's end), which is the order an uninterrupted
    run adds them in: the values are equal bit for bit on one process, under DDP up to the
    order of the sum over ranks. (A resume on another number of processes carries a tensor
    entry only if it was the same on every rank, as ``train/loss`` is.)

    Resuming with none left (saved after the epoch's last batch, in or at the end of its
    validation): Lightning's resume skips that epoch's end, so rank 0 logs its values
    itself, at the step and epoch the uninterrupted run logs them and after the validation
    the resume runs again, unless the stopped run had written that row already.

    Throughput is a measured speed, not carried: a resumed epoch's ``train/*_per_sec`` are
    measured over the batches the resumed process ran (``ThroughputMemoryMonitor``).
    """

    KEY = "train_epoch_accumulators"

    def __init__(self) -> None:
        self._loaded: dict | None = None
        self._rows: int | None = None
        self._pending: dict[str, dict] = {}  # tensor entries to add to the live ones
        self._epoch_end: dict | None = None  # an epoch end to log (rank 0)
        self._epoch_end_saved: dict | None = None  # and the record it came from
        self._resumed: dict | None = None  # the record of the epoch that goes on

    # ---- saving ----------------------------------------------------------------------
    @staticmethod
    def _entries(trainer) -> tuple[dict, dict]:
        tensors, metrics = {}, {}
        for key, item in trainer.fit_loop.epoch_loop._results.items():
            if not isinstance(item, _ResultMetric) or not item.meta.on_epoch:
                continue
            if item.is_tensor and item._update_count > 0:
                tensors[key] = item
            elif isinstance(item.value, Metric) and item.value._update_count > 0:
                metrics[key] = item
        return tensors, metrics

    @staticmethod
    def _describe(meta) -> dict:
        return {
            "log_name": meta.forked_name(False),
            "logger": bool(meta.logger),
            "reduce": _reduction(meta),
            "sync": bool(meta.sync.should),
        }

    def _tensor_records(self, trainer, tensors: dict) -> dict:
        records = {}
        for key, item in tensors.items():
            cbs = getattr(item, "cumulated_batch_size", None)
            value, count = float(item.value), float(cbs) if cbs is not None else 0.0
            records[key] = {**self._describe(item.meta), "local": (value, count)}
        for key, pend in self._pending.items():  # not yet added to the live entry
            rec = records.setdefault(key, {**pend["record"], "local": None})
            if rec["local"] is None:
                rec["local"] = (pend["value"], pend["count"])
            else:
                value, count = rec["local"]
                if rec["reduce"] in ("max", "min"):
                    pick = max if rec["reduce"] == "max" else min
                    rec["local"] = (pick(value, pend["value"]), count)
                else:  # the saved part first, as an uninterrupted run adds them
                    rec["local"] = (pend["value"] + value, pend["count"] + count)
        keys = sorted(records)
        # The same entries on every rank (the same code logged them); checked, as a
        # mismatch would make the gather below fail.
        counts = _gather(trainer, torch.tensor([len(keys)], dtype=torch.float64))
        if bool((counts != counts[0]).any()):
            rank_zero_warn("epoch accumulators: ranks logged different entries; not saved")
            return {}
        if not keys:
            return {}
        local = torch.tensor([records[k]["local"] for k in keys], dtype=torch.float64)
        states = _gather(trainer, local)  # (world, entries, 2)
        out = {}
        for i, key in enumerate(keys):
            rec = {k: v for k, v in records[key].items() if k != "local"}
            out[key] = {**rec, "states": states[:, i].clone()}
        return out

    @staticmethod
    def _metric_record(trainer, item) -> dict | None:
        metric = item.value
        reductions = {}
        for name in metric._defaults:
            fn = metric._reductions.get(name)
            reductions[name] = _STATE_REDUCTIONS.get(fn, "other")
        distributed = trainer.world_size > 1 and torch.distributed.is_initialized()
        sync = distributed and not metric._is_synced
        # Every rank joins the sync (a collective) before deciding anything.
        with metric.sync_context(
            should_sync=sync, should_unsync=sync, distributed_available=lambda: sync
        ):
            states = {}
            for name in metric._defaults:
                value = getattr(metric, name)
                if isinstance(value, list):
                    value = dim_zero_cat(value) if value else torch.zeros(0)
                states[name] = value.detach().cpu().clone()
        if "other" in reductions.values():
            return None
        return {
            **EpochAccumulatorsCheckpoint._describe(item.meta),
            "attribute": item.meta.metric_attribute,
            "states": states,
            "reductions": reductions,
            "update_count": int(metric._update_count),
        }

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        if self._epoch_end_saved is not None:
            # Saved again before the resumed epoch end was logged: carry it on (decided
            # alike on every rank: the collectives below run on all or none).
            checkpoint[self.KEY] = self._epoch_end_saved
            return
        progress = trainer.fit_loop.epoch_progress.current
        if progress.started <= progress.processed:
            return  # not inside an epoch: nothing of it to carry
        tensors, metrics = self._entries(trainer)
        records = {
            "epoch": int(trainer.current_epoch),
            "step": int(trainer.fit_loop.epoch_loop._batches_that_stepped),
            "world_size": int(trainer.world_size),
            "tensors": self._tensor_records(trainer, tensors),
            "metrics": {},
        }
        for key in sorted(metrics):
            record = self._metric_record(trainer, metrics[key])
            if record is not None:
                records["metrics"][key] = record
        if records["tensors"] or records["metrics"]:
            checkpoint[self.KEY] = records

    # ---- resuming --------------------------------------------------------------------
    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._loaded = checkpoint.get(self.KEY) if trainer.state.fn == "fit" else None
        self._rows = checkpoint.get(MetricsRowsCheckpoint.KEY)

    def on_train_start(self, trainer, pl_module) -> None:
        saved, self._loaded = self._loaded, None
        self._pending, self._epoch_end, self._epoch_end_saved = {}, None, None
        self._resumed = None
        if not isinstance(saved, dict):
            return
        processed = trainer.fit_loop.epoch_progress.current.processed
        if processed == saved["epoch"]:  # the epoch goes on: its end is Lightning's
            self._restore_metrics(trainer, pl_module, saved)
            self._pending = self._own_tensor_states(trainer, saved)
            self._resumed = saved
        elif processed == saved["epoch"] + 1:  # resumed past its batches: its end is ours
            self._epoch_end_saved = saved
            self._epoch_end = self._epoch_end_values(trainer, pl_module, saved)

    def _restore_metrics(self, trainer, pl_module, saved) -> None:
        for rec in saved["metrics"].values():
            metric = self._module_metric(pl_module, rec)
            if metric is None:
                rank_zero_warn(f"epoch accumulators: no metric {rec['attribute']!r}; restarts")
                continue
            for name, value in rec["states"].items():
                if rec["reductions"][name] in ("sum", "cat") and not trainer.is_global_zero:
                    continue  # zero here: rank 0 holds the saved sum of every rank
                self._set_state(metric, name, value)
            metric._update_count = max(metric._update_count, rec["update_count"], 1)
            metric._computed = None

    @staticmethod
    def _module_metric(pl_module, rec) -> Metric | None:
        try:
            metric = pl_module.get_submodule(rec["attribute"] or "")
        except AttributeError:
            return None
        if not isinstance(metric, Metric) or set(metric._defaults) != set(rec["states"]):
            return None
        return metric

    @staticmethod
    def _set_state(metric: Metric, name: str, value: torch.Tensor) -> None:
        if isinstance(metric._defaults[name], list):
            setattr(metric, name, [value.to(metric.device)] if value.numel() else [])
        else:
            live = getattr(metric, name)
            setattr(metric, name, value.to(device=live.device, dtype=live.dtype))

    @staticmethod
    def _own_tensor_states(trainer, saved) -> dict[str, dict]:
        pending = {}
        for key, rec in saved["tensors"].items():
            states = rec["states"]
            if states.shape[0] == trainer.world_size:
                value, count = states[trainer.global_rank].tolist()
            elif bool((states == states[0]).all()):
                value, count = states[0].tolist()
            else:
                rank_zero_warn(
                    f"epoch accumulators: {rec['log_name']} differed between the "
                    f"{states.shape[0]} processes that saved it; it restarts"
                )
                continue
            record = {k: v for k, v in rec.items() if k != "states"}
            pending[key] = {"record": record, "value": value, "count": count}
        return pending

    def _apply_pending(self, trainer) -> None:
        results = trainer.fit_loop.epoch_loop._results
        for key in list(self._pending):
            item = results.get(key)
            if not isinstance(item, _ResultMetric) or not item.is_tensor or not item._update_count:
                continue  # not logged in the resumed epoch yet
            pend = self._pending.pop(key)
            saved = torch.tensor(pend["value"], dtype=item.value.dtype, device=item.value.device)
            reduce = pend["record"]["reduce"]
            if reduce in ("max", "min"):
                item.value = item.meta.reduce_fx(saved, item.value)
            else:  # sum, mean: the saved part first, as an uninterrupted run adds them
                item.value = saved + item.value
            if reduce == "mean":
                cbs = item.cumulated_batch_size
                item.cumulated_batch_size = cbs + torch.tensor(
                    int(pend["count"]), dtype=cbs.dtype, device=cbs.device
                )
            item._computed = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._log_epoch_end(trainer)
        # From the second batch on: Lightning resets the entries at the first one.
        if self._pending and trainer._logger_connector._first_loop_iter is False:
            self._apply_pending(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._pending:
            self._apply_pending(trainer)
        saved, self._resumed = self._resumed, None
        if saved is None:
            self._pending = {}
            return
        # Entries the resumed epoch never logged (no batch of it was left, e.g. a stop in
        # its closing validation): Lightning's epoch end has nothing of them, so they are
        # logged here, from the checkpoint, and the restored metrics are emptied.
        results = trainer.fit_loop.epoch_loop._results
        unlogged = {
            "tensors": {k: r for k, r in saved["tensors"].items() if k not in results},
            "metrics": {k: r for k, r in saved["metrics"].items() if k not in results},
        }
        self._pending = {}
        for rec in unlogged["metrics"].values():
            metric = self._module_metric(pl_module, rec)
            if metric is not None:
                metric.reset()
        if unlogged["tensors"] or unlogged["metrics"]:
            values = self._epoch_end_values(trainer, pl_module, {**saved, **unlogged})
            self._epoch_end = values
            self._log_epoch_end(trainer)

    # ---- an epoch resumed at its end ---------------------------------------------------
    def _epoch_end_values(self, trainer, pl_module, saved) -> dict | None:
        if not trainer.is_global_zero:
            return None
        values = {}
        for rec in saved["tensors"].values():
            if rec["logger"]:
                values[rec["log_name"]] = self._tensor_value(rec)
        for rec in saved["metrics"].values():
            metric = self._module_metric(pl_module, rec)
            if rec["logger"] and metric is not None:
                offline = copy.deepcopy(metric)
                for name, value in rec["states"].items():
                    self._set_state(offline, name, value)
                offline._update_count = max(rec["update_count"], 1)
                offline._computed, offline._to_sync = None, False  # rank 0 alone: no sync
                values[rec["log_name"]] = float(offline.compute())
        if not values or self._row_written(trainer, saved["step"], values):
            return None
        return {"step": saved["step"], "epoch": saved["epoch"], "values": values}

    @staticmethod
    def _tensor_value(rec) -> float:
        states, reduce = rec["states"], rec["reduce"]
        if states.shape[0] == 1 or bool((states == states[0]).all()) or not rec["sync"]:
            value, count = states[0].tolist()
        elif reduce in ("max", "min"):
            value = float(states[:, 0].max() if reduce == "max" else states[:, 0].min())
            count = 0.0
        else:
            value, count = states.sum(0).tolist()
        dtype = torch.get_default_dtype()
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float32
        value = torch.tensor(value, dtype=dtype)
        if reduce == "mean":  # as _ResultMetric.compute divides
            value = value / torch.tensor(int(count))
        return float(value)

    def _row_written(self, trainer, step: int, values: dict) -> bool:
        """Whether the stopped run wrote this epoch end's row after its checkpoint."""
        if self._rows is None:
            return False
        for lg in MetricsRowsCheckpoint._csv_loggers(trainer):
            try:
                rows = read_metrics_rows(lg.metrics_path)[self._rows :]
            except (MetricsFileError, OSError):
                continue  # none, or not whole: nothing there to trust
            for row in rows:
                try:
                    at = int(float(row.get("step") or "nan"))
                except ValueError:
                    continue
                if at == step and any(row.get(name) for name in values):
                    return True
        return False

    def _log_epoch_end(self, trainer) -> None:
        pending, self._epoch_end = self._epoch_end, None
        self._epoch_end_saved = None
        if pending is not None:
            metrics = {**pending["values"], "epoch": pending["epoch"]}
            trainer._logger_connector.log_metrics(metrics, step=pending["step"])

    def on_validation_end(self, trainer, pl_module) -> None:
        # After the validation a resume runs again: its rows come first, as uninterrupted.
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._log_epoch_end(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._log_epoch_end(trainer)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as err:
            # torch.save reports a failed write (disk full, file-size limit) as a
            # RuntimeError from its zip writer.
            if isinstance(err, RuntimeError) and "writ" not in str(err).lower():
                raise
            detail = getattr(err, "strerror", None) or str(err).splitlines()[0]
            kept = f"the previous {path.name} is intact" if path.exists() else "nothing written"
            raise OSError(
                f"could not write checkpoint {path} ({detail}): {kept}; free disk space or "
                "point --runs_dir at another disk, then resume with --ckpt_path last"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)


class SaveOnSigterm(L.Callback):
    """``last.ckpt`` at the step a SIGTERM, a SIGHUP or a Ctrl-C stopped ``fit``, and the
    command that resumes it; the resumed run ends as one never stopped.

    Lightning raises ``SIGTERMException`` at the next batch boundary after a SIGTERM. While
    a fit trains, a first Ctrl-C (SIGINT) and a SIGHUP (a closed terminal) ask for the same
    stop instead of killing the step where it is; a second Ctrl-C aborts at once, without a
    checkpoint (``interrupts.Interrupted``).

    A stop inside a validation saves the loop state of that validation's start and marks
    the checkpoint (``RERUN_KEY``): the resumed run runs the whole validation again, so its
    metrics, best checkpoint and ``last.ckpt`` are those of an uninterrupted run (Lightning
    would skip it). A stop saved after a finished validation holds Lightning's logging step
    one back, as its own checkpoints at the end of a validation do: Lightning's resume adds
    that one again.
    """

    RERUN_KEY = "rerun_validation"

    def __init__(self, resume_command: str | None = None) -> None:
        self.resume_command = resume_command
        self.reason = "SIGTERM"
        self._stop_signal: int | None = None
        self._previous: dict = {}
        self._val_progress: dict | None = None  # the val loop's progress as a validation starts
        self._stepped_at_val: int | None = None
        self._validated_at: int | None = None
        self._in_validation = False
        self._stopped_in_validation = False
        self._rerun = False

    # ---- signals -------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self._rerun:
            self._rerun = False
            # Lightning's resume runs a validation it finds begun (and skips one it finds
            # finished): the checkpoint holds the progress of its start, so it runs whole.
            trainer.fit_loop.epoch_loop.val_loop._restart_stage = _MID_EVALUATION
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        # After Lightning set its SIGTERM handler (it does once on_fit_start has run).
        for signum in (signal.SIGINT, signal.SIGHUP):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, functools.partial(self._on_signal, trainer))
        # interrupts' handler, which Lightning's SIGTERM handler also calls: name the stop.
        interrupts.graceful = functools.partial(self._note, trainer)

    def _note(self, trainer, signum: int) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self.reason = interrupts.NAMES.get(signum, f"signal {signum}")
        trainer._signal_connector.received_sigterm = True

    def _on_signal(self, trainer, signum, frame) -> None:
        if self._stop_signal == signal.SIGINT and signum == signal.SIGINT:
            raise interrupts.Interrupted(signum)  # a second Ctrl-C: abort, no checkpoint
        first = self._stop_signal is None
        self._note(trainer, signum)
        if first:
            what = interrupts.NAMES[signum]
            again = ""
            if signum == signal.SIGINT:
                again = " (Ctrl-C again aborts at once, without saving)"
            with contextlib.suppress(OSError, ValueError):  # a closed terminal
                print(
                    f"\n{what}: stopping at the end of this batch to save last.ckpt{again}",
                    file=sys.stderr,
                    flush=True,
                )
        # Other DDP ranks stop through Lightning's launcher, as on a SIGTERM.
        launcher = trainer.strategy.launcher
        if first and launcher is not None and hasattr(launcher, "kill"):
            with contextlib.suppress(Exception):
                launcher.kill(signal.SIGTERM)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        interrupts.graceful = None
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # ---- validations -----------------------------------------------------------------------
    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        loop = trainer.fit_loop.epoch_loop
        self._val_progress = copy.deepcopy(loop.val_loop.batch_progress.state_dict())
        self._stepped_at_val = loop._batches_that_stepped
        self._in_validation = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._in_validation = False
            self._validated_at = trainer.global_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        loops = checkpoint.get("loops", {}).get("fit_loop")
        if trainer.state.fn != "fit" or not isinstance(loops, dict):
            return
        if self._stopped_in_validation and self._val_progress is not None:
            loops["epoch_loop.val_loop.batch_progress"] = copy.deepcopy(self._val_progress)
            checkpoint[self.RERUN_KEY] = True
        elif (
            self._validated_at == trainer.global_step
            and self._stepped_at_val is not None
            and trainer.fit_loop.epoch_loop._batches_that_stepped == self._stepped_at_val + 1
        ):
            # Saved after the step that follows a validation was counted (a stop, the end of
            # training): Lightning's resume counts it again.
            state = loops.get("epoch_loop.state_dict")
            if isinstance(state, dict) and "_batches_that_stepped" in state:
                state["_batches_that_stepped"] = self._stepped_at_val

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._rerun = bool(checkpoint.get(self.RERUN_KEY)) and trainer.state.fn == "fit"

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        exception.stop_reason = self.reason
        exception.stop_signal = self._stop_signal or signal.SIGTERM
        ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
        if ckpt is None or ckpt.dirpath is None:
            return
        path = Path(ckpt.dirpath) / f"{ckpt.CHECKPOINT_NAME_LAST}{ckpt.FILE_EXTENSION}"
        self._stopped_in_validation = self._in_validation
        try:
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._stopped_in_validation = False
        how = f": {self.resume_command}" if self.resume_command else " --ckpt_path last"
        step = trainer.global_step
        where = " (in a validation, which the resume runs again)" if self._in_validation else ""
        rank_zero_info(f"{self.reason}: saved {path} at step {step}{where}; resume with{how}")


class LatestCheckpoint(ModelCheckpoint):
    """``last.ckpt`` at the latest step: after every validation and when training ends.

    Lightning 2.6 refreshes a monitored checkpoint's ``last.ckpt`` only when the metric
    improves, and an unmonitored one saves only at validation, so a run that ends between
    validations would leave ``--ckpt_path last`` a stale step.
    """

    def __init__(self, *, dirpath: str) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="last",
            monitor=None,
            save_top_k=1,
            enable_version_counter=False,
        )

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        if trainer.global_step != self._last_global_step_saved:
            trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt", weights_only=False)
            self._last_global_step_saved = trainer.global_step
