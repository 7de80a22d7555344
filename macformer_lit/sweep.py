"""``python -m macformer_lit sweep FILE``: a grid of CLI runs, a results table and a plot.

Each grid point is one ``python -m macformer_lit <command> ...`` subprocess, so a failing
run is reported and the others go on. Before any runs, every point's command is parsed by the
CLI's own parser in this process (``resolve_settings``): settings every point shares that do
not parse stop the sweep once; a point whose own settings do not parse fails without
starting. A point whose run finished with the settings it resolves to now is not run again;
one whose settings changed since runs again into a new version (``--no_rerun_changed``:
refused), and is never tabled as done with its old run; an interrupted ``fit`` resumes from
its ``last.ckpt`` (``--ckpt_path last``) when that run had the same settings, else starts a
new version. One whole-grid sweep per sweep folder and one process per point at a time
(``locks``). A run whose ``metrics.csv`` holds a row that is not whole is flagged in the
table (``bad metrics.csv``), its numbers left out. Afterwards the
sweep writes ``results.md`` and ``results.csv`` (final and best validation loss, PPL and
BLEU, test BLEU, time, peak memory, throughput per run), ``results_mean.*`` (mean ± sample
standard deviation, n-1, over the seed axes) and ``curves.png`` (the metrics per epoch: one
colour per method, i.e. per value of the axes other than the seed axes, its mean over
seeds as a line and their min–max as a band; labels of ``plot.dashed`` on the style axis
are drawn dashed, as the Macformer paper's Fig. 3 draws the baseline).

Sweep file (YAML)::

    name: multi30k_ppsbn              # folder under --runs_dir holding every run
    command: fit                      # CLI subcommand (default fit)
    config: [multi30k.yaml]           # --config files of every run (str or list)
    args:                             # overrides of every run, dotted keys as on the CLI
      trainer.max_epochs: 20
    axes:                             # the grid: the product of all axes, in this order
      ppsbn:                          # axis name
        baseline: {}                  # label: its overrides ({} = none)
        ppsbn:
          model.init_args.attention: {name: softmax, pre_sbn: true, post_sbn: true}
      seed:
        "0": {seed_everything: 0}
        "1": {seed_everything: 1, config: [extra.yaml]}   # a label may add --config files
    plot:
      style_axis: ppsbn               # the axis that sets the line style (default: first)
      dashed: [baseline]              # its labels drawn dashed; the others solid
      metrics: [val/loss, val/ppl, val/bleu]
    report:
      average_over: [seed]            # the seed axes: a table of means over them, and the
                                      # plot's bands (default: the axes named *seed*)

Every run lands in ``<runs_dir>/<name>/<axis>=<label>,.../version_<n>/``. Config paths are
looked up as given, then beside the sweep file and in its parent folder (so
``configs/sweeps/*.yaml`` can name ``multi30k.yaml``), then among the shipped configs.

W&B: ``--wandb_sweep OUT.yaml`` writes a grid sweep over the same axes whose command runs
``sweep FILE --point --<axis>=<label> ...`` (one point per agent call); then
``wandb sweep OUT.yaml`` and ``wandb agent <id>``, and ``sweep FILE --report_only`` for
the table and plot.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import functools
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

from macformer_lit import locks, provenance, yamlio
from macformer_lit.metrics_file import MetricsFileError, read_metrics_rows, replace_whole
from macformer_lit.plotting import colours_for, legend_below, plot_bands, pyplot
from macformer_lit.preflight import UsageError, check_config_file
from macformer_lit.report import BOOKKEEPING
from macformer_lit.runs import newest_version

PR_SET_PDEATHSIG = 1  # linux/prctl.h

FILE_KEYS = {"name", "command", "config", "args", "axes", "plot", "report"}
# x: the curves' axis, epochs (the default) or training steps (for runs inside one epoch).
PLOT_KEYS = {"style_axis", "dashed", "metrics", "x"}
STATUS_FILE = "sweep_status.json"
LOG_FILE = "sweep_run.log"
DEFAULT_METRICS = ["val/loss", "val/ppl", "val/bleu"]
METRIC_TITLES = {
    "val/loss": "validation loss (label-smoothed CE)",
    "val/ppl": "validation perplexity",
    "val/bleu": "validation BLEU (sacreBLEU)",
    "val/bleu_tok": "validation BLEU (tokenised, lower-cased)",
    "val/acc": "validation accuracy",
    "train/loss_epoch": "training loss",
}


class SweepError(ValueError):
    """The sweep file is malformed; the message says where."""


# ---- the sweep file ------------------------------------------------------------------------
def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in (value if isinstance(value, list) else [value])]


def load_sweep(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {path} does not exist")
    try:
        # YAML syntax, keys given twice, tabs, empty, not a mapping: one line
        check_config_file(str(path))
    except UsageError as err:
        raise SweepError(f"sweep {err.code} (name, config, args, axes, ...)") from None
    spec = yamlio.load_file(path)
    unknown = sorted(set(spec) - FILE_KEYS)
    if unknown:
        raise SweepError(
            f"{path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(FILE_KEYS))}"
        )
    spec.setdefault("name", path.stem)
    spec.setdefault("command", "fit")
    if not re.fullmatch(r"[\w.+-]+", str(spec["name"])):
        raise SweepError(f"{path}: name {spec['name']!r} must be a plain folder name")
    axes = spec.get("axes")
    if not isinstance(axes, dict) or not axes:
        raise SweepError(f"{path}: 'axes' must map each axis name to {{label: overrides}}")
    for axis, values in axes.items():
        if not isinstance(values, dict) or not values:
            raise SweepError(f"{path}: axis {axis!r} must map labels to overrides")
        for label, overrides in values.items():
            if overrides is not None and not isinstance(overrides, dict):
                raise SweepError(f"{path}: {axis}={label}: overrides must be a mapping or empty")
            if not re.fullmatch(r"[\w.+-]+", str(label)):
                raise SweepError(f"{path}: label {label!r} of axis {axis!r} must be a plain word")
        # YAML tells 0 from "0"; a point's folder and --point do not.
        texts = [str(label) for label in values]
        twice = sorted({t for t in texts if texts.count(t) > 1})
        if twice:
            raise SweepError(
                f"{path}: axis {axis!r} has the label {twice[0]!r} twice (once quoted, once "
                "not): labels are compared as text; keep one"
            )
    if not isinstance(spec.get("args") or {}, dict):
        raise SweepError(f"{path}: 'args' must be a mapping of dotted keys to values")
    plot = spec.setdefault("plot", {}) or {}
    unknown = sorted(set(plot) - PLOT_KEYS)
    if unknown:
        raise SweepError(
            f"{path}: plot has unknown key(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(PLOT_KEYS))}"
        )
    if plot.get("x", "epoch") not in ("epoch", "step"):
        raise SweepError(f"{path}: plot.x must be epoch or step; got {plot['x']!r}")
    style_axis = plot.get("style_axis", next(iter(axes)))
    if style_axis not in axes:
        raise SweepError(
            f"{path}: plot.style_axis {style_axis!r} is not an axis ({', '.join(axes)})"
        )
    spec["plot"] = {
        "style_axis": style_axis,
        "dashed": [str(x) for x in plot.get("dashed", [])],
        "metrics": list(plot.get("metrics", DEFAULT_METRICS)),
        "x": plot.get("x", "epoch"),
    }
    report = spec.get("report") or {}
    spec["report"] = {"average_over": as_list(report.get("average_over"))}
    for axis in spec["report"]["average_over"]:
        if axis not in axes:
            raise SweepError(f"{path}: report.average_over names {axis!r}, which is not an axis")
    spec["path"] = path
    return spec


def grid(spec: dict[str, Any]) -> list[dict[str, str]]:
    """Every point as ``{axis: label}``, in file order."""
    axes = spec["axes"]
    return [
        dict(zip(axes, labels))
        for labels in itertools.product(*(map(str, v) for v in axes.values()))
    ]


def point_name(point: dict[str, str]) -> str:
    return ",".join(f"{axis}={label}" for axis, label in point.items())


def resolve_config(name: str, sweep_path: Path) -> str:
    for candidate in (Path(name), sweep_path.parent / name, sweep_path.parent.parent / name):
        if candidate.is_file():
            return str(candidate)
    return name  # the CLI looks among the shipped configs


def cli_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def run_command(
    spec: dict[str, Any],
    point: dict[str, str],
    *,
    runs_dir: Path,
    wandb_mode: str,
    extra: list[str],
    resume: bool = True,
) -> list[str]:
    """The point's command line; ``resume``: a fit goes on from its run's ``last.ckpt``."""
    configs = as_list(spec.get("config"))
    overrides = dict(spec.get("args") or {})
    for axis, label in point.items():
        values = dict(spec["axes"][axis][_label_key(spec["axes"][axis], label)] or {})
        configs += as_list(values.pop("config", None))
        overrides.update(values)
    cmd = [sys.executable, "-m", "macformer_lit", spec["command"]]
    for name in configs:
        cmd += ["--config", resolve_config(name, spec["path"])]
    for key, value in overrides.items():
        cmd += [f"--{key}", cli_value(value)]
    # No point: the settings every point shares (checked once, before any point runs).
    experiment = point_name(point) or "shared"
    cmd += ["--runs_dir", str(runs_dir / spec["name"]), "--experiment", experiment]
    cmd += ["--wandb_mode", wandb_mode]
    if spec["command"] == "fit" and resume:
        cmd += ["--ckpt_path", "last"]
    return cmd + extra


def _label_key(values: dict, label: str):
    # YAML may have read a label such as 0 or 1e-3 as a number.
    return next(k for k in values if str(k) == label)


# ---- a point's settings against its run's -------------------------------------------------
class _Resolved(Exception):
    """Carries a command line's resolved config out of the CLI before it builds anything."""


def resolve_settings(cmd: list[str]) -> dict[str, Any] | str | None:
    """The config ``cmd`` (a CLI command line) resolves to, as its run's ``config.yaml``
    records it; the CLI's one-line error when it does not parse; None when the check itself
    failed (the run then reports for itself). In this process: the CLI's parser and checks,
    nothing built."""
    from macformer_lit import cli  # torch and Lightning: only once runs are checked

    args = cmd[cmd.index("macformer_lit") + 1 :]
    every = cli.MacformerCLI.subcommands()

    class Resolve(cli.MacformerCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            # Only the point's own subcommand's parser: each one takes about as long to
            # build as the parse (a screen report builds dozens). The same parser the run's
            # CLI parses with, so the same config; an unknown subcommand gets all of them
            # (and the parser's own error).
            return {args[0]: every[args[0]]} if args and args[0] in every else every

        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)  # with the CLI's checks (preflight)
            sub = self.config["subcommand"]
            self._check_attention(self.config[sub])
            raise _Resolved(self._parser(sub).dump(self.config[sub], skip_none=False))

    try:
        with warnings.catch_warnings():
            # LightningCLI warns when given args while sys.argv holds the sweep's own: here
            # that is the point (the point's command line is parsed in the sweep process).
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run")
            Resolve(args)
    except _Resolved as done:
        return yamlio.load(done.args[0])
    except SystemExit as err:  # UsageError, an unknown config, --help
        if not err.code:
            return None
        text = str(err.code).removeprefix("macformer_lit: error: ")
        return text.splitlines()[0].strip()
    except (ValueError, OSError) as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    except Exception:
        return None
    return None


def resolve_points(
    spec: dict[str, Any], points: list[dict[str, str]], **how: Any
) -> dict[str, dict | str | None]:
    """Each point's resolved settings (``resolve_settings``), by point name.

    Raises ``SweepError`` when every point fails with the error of the settings they share
    (config, args, the arguments after '--'): one line for the sweep, not one per point."""
    resolved = {point_name(p): resolve_settings(run_command(spec, p, **how)) for p in points}
    errors = {v for v in resolved.values() if isinstance(v, str)}
    if len(errors) == 1 and all(isinstance(v, str) for v in resolved.values()):
        shared = resolve_settings(run_command(spec, {}, **how))
        if isinstance(shared, str) and shared in errors:
            raise SweepError(
                f"{spec['path']}: the settings every point shares (config, args and the "
                f"arguments after '--') do not parse: {shared}"
            )
    return resolved


def option_values(config: dict[str, Any]) -> dict[str, Any]:
    """A run config's options by dotted name, each value whole (an attention spec is one
    value, so a key added to it is a change). An entry of the callbacks group is whether it
    is on and each of its settings (a setting added since is not a change)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "callbacks" and isinstance(value, dict):
            for name, entry in value.items():
                out[f"{key}.{name}"] = entry is not False
                if isinstance(entry, dict):
                    out.update({f"{key}.{name}.{k}": v for k, v in entry.items()})
        elif isinstance(value, dict) and "class_path" in value:
            out[f"{key}.class_path"] = value["class_path"]
            for k, v in (value.get("init_args") or {}).items():
                out[f"{key}.init_args.{k}"] = v
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _text(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def changed_settings(recorded: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each option whose value differs. Bookkeeping (names, paths,
    W&B, what is logged: ``report.BOOKKEEPING``) is not compared, nor an option the run's
    ``config.yaml`` lacks (the code gained it since), nor ``seed_everything: true`` (a new
    random seed every run)."""
    old, new = option_values(recorded), option_values(resolved)
    changes = []
    for key, value in new.items():
        if key not in old or any(key == b or key.startswith(b + ".") for b in BOOKKEEPING):
            continue
        if key == "seed_everything" and value is True:
            continue
        if old[key] != value:
            changes.append(f"{key}: {_text(old[key])} -> {_text(value)}")
    return changes


def run_changes(run_dir: str | Path | None, settings: dict | str | None) -> list[str]:
    """How ``settings`` differ from the run in ``run_dir`` (its ``config.yaml``); [] when
    they do not, or cannot be compared (``settings`` unknown)."""
    if not isinstance(settings, dict):
        return []
    path = Path(run_dir or "") / "config.yaml"
    if not run_dir or not path.is_file():
        return [f"{path.parent}: no config.yaml records what ran"]
    try:
        recorded = yamlio.load(path.read_text(encoding="utf-8"))
        if isinstance(recorded, dict):
            # With the changes its resumes recorded (a resume never rewrites config.yaml).
            recorded = provenance.effective_config(recorded, provenance.read(path.parent))
    except (yaml.YAMLError, UnicodeDecodeError, provenance.RecordError) as err:
        return [f"{path.parent}: its records cannot be read ({str(err).splitlines()[0]})"]
    if not isinstance(recorded, dict):
        return [f"{path} is not a run config"]
    return changed_settings(recorded, settings)


# ---- running -------------------------------------------------------------------------------
def point_dir(spec: dict[str, Any], point: dict[str, str], runs_dir: Path) -> Path:
    return runs_dir / spec["name"] / point_name(point)


def read_status(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def located_status(folder: Path) -> dict[str, Any] | None:
    """A point's status, its ``run_dir`` found again inside ``folder``: a copied or moved
    sweep folder, such as the committed ``results/<sweep>/``, reports from its own runs,
    never from the recorded path (where the sweep ran), even where that path still exists
    and holds other runs by now."""
    status = read_status(folder)
    if status and status.get("run_dir"):
        recorded = Path(status["run_dir"])
        own = folder / recorded.name
        if own.is_dir():
            status["run_dir"] = str(own)
        elif not recorded.is_dir():
            newest = newest_version(folder)
            status["run_dir"] = str(newest) if newest else None
    return status


def run_point(
    spec: dict[str, Any],
    point: dict[str, str],
    *,
    runs_dir: Path,
    wandb_mode: str,
    extra: list[str],
    retry_failed: bool,
    label: str = "",
    settings: dict | str | None = None,
    rerun_changed: bool = True,
) -> dict[str, Any]:
    """Run one point unless its run is done with ``settings`` (``resolve_settings``); one
    process at a time per point folder (``locks``)."""
    folder = point_dir(spec, point, runs_dir)
    name = point_name(point)
    try:
        locks.note(locks.hold(folder, "sweep"))
    except locks.FolderInUse as err:
        print(f"{label}{name}: skipped: {err.code}", flush=True)
        return {"status": "busy", "error": str(err.code)}
    try:
        return _run_point(
            spec,
            point,
            folder,
            runs_dir=runs_dir,
            wandb_mode=wandb_mode,
            extra=extra,
            retry_failed=retry_failed,
            label=f"{label}{name}: ",
            settings=settings,
            rerun_changed=rerun_changed,
        )
    finally:
        locks.release(folder)


def _run_point(
    spec: dict[str, Any],
    point: dict[str, str],
    folder: Path,
    *,
    runs_dir: Path,
    wandb_mode: str,
    extra: list[str],
    retry_failed: bool,
    label: str,
    settings: dict | str | None,
    rerun_changed: bool,
) -> dict[str, Any]:
    status = located_status(folder)
    done = bool(status) and status.get("status") == "done"
    if status and status.get("status") == "failed" and not retry_failed:
        print(f"{label}failed before, skipped (--no_retry_failed)", flush=True)
        return status
    how = {"runs_dir": runs_dir, "wandb_mode": wandb_mode, "extra": extra}
    cmd = run_command(spec, point, **how)
    if isinstance(settings, str):
        # The CLI would stop at once: say so without starting it (a done run's record stays).
        print(f"{label}FAILED (its settings do not parse): {settings}", flush=True)
        failed = {
            "status": "failed",
            "returncode": 2,
            "wall_time_s": 0.0,
            "run_dir": None,
            "point": point,
            "command": shlex.join(cmd),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "error": settings,
        }
        if not done:
            with open(folder / LOG_FILE, "a", encoding="utf-8") as log:
                log.write(f"$ {shlex.join(cmd)}\nmacformer_lit: error: {settings}\n")
            (folder / STATUS_FILE).write_text(json.dumps(failed, indent=2))
        return {**(status or {}), **failed} if done else failed
    replaces = None
    if done:
        changes = run_changes(status.get("run_dir"), settings)
        if not changes:
            print(f"{label}done before, skipped ({status.get('run_dir')})", flush=True)
            return status
        why = f"settings changed since its run {status.get('run_dir')}: {'; '.join(changes)}"
        if not rerun_changed:
            print(f"{label}{why}; not run again (--no_rerun_changed)", flush=True)
            return {**status, "status": "changed", "error": why}
        print(f"{label}{why}; running it again into a new version", flush=True)
        cmd, replaces = run_command(spec, point, **how, resume=False), status.get("run_dir")
    elif spec["command"] == "fit":
        # --ckpt_path last goes on from the newest last.ckpt: only a run of these settings.
        from macformer_lit.checkpoints import newest_checkpoint

        last = newest_checkpoint(folder, "last")
        changes = run_changes(last.parent.parent, settings) if last else []
        if changes:
            print(
                f"{label}its unfinished run {last.parent.parent} had other settings "
                f"({'; '.join(changes)}): starting a new version instead of resuming it",
                flush=True,
            )
            cmd = run_command(spec, point, **how, resume=False)
    log_path = folder / LOG_FILE
    print(f"{label}running (log: {log_path})", flush=True)
    env = dict(os.environ)
    env.setdefault("WANDB_RUN_GROUP", str(spec["name"]))
    env.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        returncode, stop = _run_child(cmd, log, env)
    elapsed = time.perf_counter() - start
    if stop is not None:
        # The child stopped on the forwarded signal (a fit saved last.ckpt): not a failure,
        # and the next sweep resumes it. A point that never got a run folder leaves none.
        if status is None and newest_version(folder) is None:
            locks.release(folder)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            interrupted = {
                "status": "interrupted",
                "returncode": returncode,
                "point": point,
                "command": shlex.join(cmd),
                "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            if not done:
                (folder / STATUS_FILE).write_text(json.dumps(interrupted, indent=2))
        raise SweepInterrupted(stop)
    proc = subprocess.CompletedProcess(cmd, returncode)
    with open(log_path, encoding="utf-8", errors="replace") as log:
        log.seek(offset)
        text = log.read()  # this run's output only: an earlier run's folder is not this one's
    found = re.findall(r"^Run folder: (.+)$", text, flags=re.MULTILINE)
    run_dir = found[-1].strip() if found else (str(newest_version(folder) or "") or None)
    status = {
        "status": "done" if proc.returncode == 0 else "failed",
        "returncode": proc.returncode,
        "wall_time_s": elapsed,
        "run_dir": run_dir,
        "point": point,
        "command": shlex.join(cmd),
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if replaces:
        status["replaces"] = replaces  # the run of the settings before, kept
    if proc.returncode != 0:
        status["error"] = last_error(text)
        print(f"{label}FAILED (exit {proc.returncode}): {status['error']}", flush=True)
    else:
        print(f"{label}done in {elapsed:.0f} s ({run_dir})", flush=True)
    (folder / STATUS_FILE).write_text(json.dumps(status, indent=2))
    return status


class SweepInterrupted(Exception):
    """A stop signal reached the sweep; its point's child was stopped with it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_with_parent(parent: int) -> None:
    """In the point's process before it starts (Linux): SIGTERM when the sweep dies, even by
    SIGKILL, so the point saves ``last.ckpt`` and stops instead of training on unwatched
    (its own session keeps it out of the sweep's process group)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return
    except (OSError, AttributeError):
        return  # not Linux: no parent-death signal
    if os.getppid() != parent:  # the sweep died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _run_child(cmd: list[str], log, env: dict) -> tuple[int, int | None]:
    """Run a point's process to its end; a stop signal to the sweep is passed on to it once
    per signal (its own session: a terminal's Ctrl-C reaches the sweep alone, so a first
    Ctrl-C saves the fit's last.ckpt and a second aborts it, as for a fit run by hand), and
    the sweep waits for it. Returns the exit code and the first stop signal, if any."""
    from macformer_lit import interrupts

    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=functools.partial(_stop_with_parent, os.getpid()),
    )
    stop = None
    while True:
        try:
            return proc.wait(), stop
        except (interrupts.Interrupted, KeyboardInterrupt) as err:
            signum = getattr(err, "signum", signal.SIGINT)
            stop = stop or signum
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass


def last_error(text: str) -> str:
    """The final exception line of a run's output, with jsonargparse's listed reasons."""
    lines = text.splitlines()
    found = [
        i
        for i, line in enumerate(lines)
        if re.match(r"^[\w.]*(Error|Exception)\b", line) or re.match(r"^\S+: error:", line)
    ]
    if not found:
        rest = [ln.strip() for ln in lines if ln.strip()]
        return (rest[-1] if rest else "no output")[:500]
    message = lines[found[-1]].strip()
    # jsonargparse lists why each alternative failed as "  - reason" lines below.
    reasons = [
        ln.strip()[2:]
        for ln in lines[found[-1] + 1 :]
        if ln.strip().startswith("- ") and "Expected a <class 'NoneType'>" not in ln
    ]
    return (message + (": " + "; ".join(reasons) if reasons else ""))[:500]


# ---- results -------------------------------------------------------------------------------
def read_metrics(run_dir: str | Path | None) -> list[dict[str, str]]:
    """A run's metrics.csv rows; ``MetricsFileError`` names a row that is not whole."""
    if not run_dir:
        return []
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return []
    return read_metrics_rows(path)


def series(rows: list[dict[str, str]], key: str, x: str = "epoch") -> list[tuple[int, float]]:
    """``(epoch, value)`` for each epoch that logged ``key`` (the last value of an epoch), or
    ``(step, value)`` for each step with ``x="step"``."""
    per_x: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if value in (None, ""):
            continue
        per_x[int(float(row.get(x) or 0))] = float(value)
    return sorted(per_x.items())


def last_value(rows: list[dict[str, str]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    return values[-1] if values else None


def summarise(
    spec: dict[str, Any], point: dict[str, str], status: dict[str, Any] | None
) -> dict[str, Any]:
    status = status or {"status": "not run"}
    out: dict[str, Any] = {"run": point_name(point), **point}
    out["status"] = status["status"]
    try:
        rows = read_metrics(status.get("run_dir"))
    except MetricsFileError as err:  # its numbers cannot be trusted: none are tabled
        rows, status = [], {**status, "status": "bad metrics.csv", "error": str(err)}
        out["status"] = status["status"]
    if status["status"] == "failed":
        out["status"] = f"failed (exit {status.get('returncode')})"
    loss, ppl, bleu = (series(rows, k) for k in ("val/loss", "val/ppl", "val/bleu"))
    out["epochs"] = max((e + 1 for e, _ in loss), default=None)
    for name, s, best in (("val_loss", loss, min), ("val_ppl", ppl, min), ("val_bleu", bleu, max)):
        values = [v for _, v in s if math.isfinite(v)]
        out[f"{name}_final"] = s[-1][1] if s else None
        out[f"{name}_best"] = best(values) if values else None
    for key in ("test/loss", "test/ppl", "test/bleu", "test/bleu_tok", "test/acc"):
        value = last_value(rows, key)
        if value is not None:
            out[key.replace("/", "_")] = value
    out["time_s"] = status.get("wall_time_s")
    gpu = [float(r["train/peak_gpu_mem_mb"]) for r in rows if r.get("train/peak_gpu_mem_mb")]
    rss = [float(r["train/peak_rss_mb"]) for r in rows if r.get("train/peak_rss_mb")]
    out["peak_mem_mb"] = max(gpu or rss) if (gpu or rss) else None
    out["mem_kind"] = "gpu" if gpu else ("rss" if rss else None)
    speed = [float(r["train/tokens_per_sec"]) for r in rows if r.get("train/tokens_per_sec")]
    out["tokens_per_s"] = sum(speed) / len(speed) if speed else None
    out["run_dir"] = status.get("run_dir")
    out["error"] = status.get("error")
    return out


def columns_of(table: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in table:
        cols += [c for c in row if c not in cols]
    return [c for c in cols if any(row.get(c) is not None for row in table)]


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value).replace("|", "\\|")


def write_tables(
    table: list[dict[str, Any]], out_dir: Path, stem: str, note: str = ""
) -> tuple[Path, Path]:
    cols = columns_of(table)
    csv_path, md_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.md"
    # Whole files, renamed into place: a sweep --point beside another may write them too.
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(table)
    replace_whole(csv_path, text.getvalue())
    # Markdown shows a mean and its standard deviation in one cell: "m ± s".
    md_cols = [
        c
        for c in cols
        if c not in ("run_dir", "error") and not (c.endswith("_std") and f"{c[:-4]}_mean" in cols)
    ]

    def cell(row: dict[str, Any], col: str) -> str:
        std = f"{col[:-5]}_std"
        if col.endswith("_mean") and row.get(std) is not None:
            return f"{fmt(row.get(col))} ± {row[std]:.2g}"
        return fmt(row.get(col))

    header = [c[:-5] if c.endswith("_mean") else c for c in md_cols]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(md_cols)]
    lines += ["| " + " | ".join(cell(row, c) for c in md_cols) + " |" for row in table]
    if note:
        lines += ["", note]
    failed = [row for row in table if row.get("error")]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- `{row['run']}`: {row['error']}" for row in failed]
    replace_whole(md_path, "\n".join(lines) + "\n")
    return md_path, csv_path


def averaged(table: list[dict[str, Any]], axes: list[str], over: list[str]) -> list[dict[str, Any]]:
    """Mean and sample standard deviation (n-1; None for one run) of numeric columns over
    the ``over`` axes."""
    keep = [a for a in axes if a not in over]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in table:
        if row["status"] == "done":
            groups.setdefault(tuple(row[a] for a in keep), []).append(row)
    out = []
    for key, rows in groups.items():
        agg: dict[str, Any] = {**dict(zip(keep, key)), "runs": len(rows)}
        for col in columns_of(rows):
            values = [
                r[col] for r in rows if isinstance(r.get(col), (int, float)) and col not in keep
            ]
            if values and len(values) == len(rows) and col != "epochs":
                agg[f"{col}_mean"] = statistics.fmean(values)
                agg[f"{col}_std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(agg)
    return out


def seed_axes(spec: dict[str, Any]) -> list[str]:
    """The axes a method is averaged over: ``report.average_over``, else those named *seed*."""
    return spec["report"]["average_over"] or [a for a in spec["axes"] if "seed" in a.lower()]


def method_of(spec: dict[str, Any], point: dict[str, str]) -> str:
    """A point's method: its labels on the axes other than the seed axes."""
    over = seed_axes(spec)
    return point_name({a: v for a, v in point.items() if a not in over}) or "all runs"


def method_curves(
    spec: dict[str, Any], points: list[dict[str, str]], statuses: list[dict | None], key: str
) -> dict[str, list[list[tuple[float, float]]]]:
    """Per method, in grid order, each of its runs' ``(epoch, value)`` points of ``key``."""
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for point, status in zip(points, statuses):
        try:
            rows = read_metrics((status or {}).get("run_dir"))
        except MetricsFileError:
            rows = []  # flagged in the table
        x = spec["plot"]["x"]
        shift = 1 if x == "epoch" else 0  # epochs counted from 1, steps as logged
        run = [(float(e + shift), v) for e, v in series(rows, key, x)]
        curves.setdefault(method_of(spec, point), []).append(run)
    return curves


def majority_share(statuses: list[dict | None]) -> float | None:
    """The validation split's majority-class share as the runs logged it
    (``val/majority_acc``), for the accuracy panel's reference line; None if none did."""
    for status in statuses:
        try:
            rows = read_metrics((status or {}).get("run_dir"))
        except MetricsFileError:
            continue
        values = series(rows, "val/majority_acc")
        if values:
            return values[-1][1]
    return None


def plot_curves(
    spec: dict[str, Any], points: list[dict[str, str]], statuses: list[dict | None], path: Path
) -> Path:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    metrics = spec["plot"]["metrics"]
    style_axis, dashed = spec["plot"]["style_axis"], set(spec["plot"]["dashed"])
    over = seed_axes(spec)
    methods = list(dict.fromkeys(method_of(spec, p) for p in points))
    colours = colours_for(methods)
    styles = {
        method_of(spec, p): "--" if style_axis not in over and p[style_axis] in dashed else "-"
        for p in points
    }
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False, layout="constrained"
    )
    for ax, key in zip(axes[0], metrics):
        plot_bands(
            ax, method_curves(spec, points, statuses, key), colours=colours, linestyles=styles
        )
        majority = majority_share(statuses) if key == "val/acc" else None
        if majority is not None:
            ax.axhline(majority, color="0.4", linestyle="--", linewidth=1,
                       label="majority class (validation)")  # fmt: skip
        ax.set_title(METRIC_TITLES.get(key, key))
        ax.set_xlabel(spec["plot"]["x"])
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        values = [v for ln in ax.lines for v in ln.get_ydata() if math.isfinite(v)]
        # Early perplexities dwarf the late ones: a log axis keeps both readable.
        if key.endswith("ppl") and values and min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
    legend_below(fig, axes[0], ncol=4)
    title = spec["name"]
    if over:
        title += f": mean over {', '.join(over)} (line), min–max (band)"
    if dashed and style_axis not in over:
        title += f"; {style_axis} {', '.join(sorted(dashed))} dashed"
    fig.suptitle(title)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    plt.close(fig)
    return path


def checked_status(
    status: dict[str, Any] | None, settings: dict | str | None
) -> dict[str, Any] | None:
    """A done point's status, unless its settings now differ from its run's or do not parse
    (``resolve_settings``): then it is not tabled as done."""
    if not status or status.get("status") != "done":
        return status
    if isinstance(settings, str):
        return {**status, "status": "failed", "returncode": 2, "error": settings}
    changes = run_changes(status.get("run_dir"), settings)
    if changes:
        why = f"settings changed since this run: {'; '.join(changes)}"
        return {**status, "status": "changed", "error": why}
    return status


def report(
    spec: dict[str, Any], runs_dir: Path, resolved: dict[str, Any] | None = None
) -> dict[str, Path]:
    """The tables and plot; ``resolved`` (``resolve_points``) checks each done run's
    settings against the sweep file's."""
    points = grid(spec)
    statuses = [located_status(point_dir(spec, p, runs_dir)) for p in points]
    if resolved is not None:
        statuses = [
            checked_status(s, resolved.get(point_name(p))) for p, s in zip(points, statuses)
        ]
    table = [summarise(spec, p, s) for p, s in zip(points, statuses)]
    out_dir = runs_dir / spec["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = write_tables(table, out_dir, "results")
    outputs = {"markdown": md, "csv": csv_path}
    over = spec["report"]["average_over"]
    if over:
        outputs["mean_markdown"], outputs["mean_csv"] = write_tables(
            averaged(table, list(spec["axes"]), over),
            out_dir,
            "results_mean",
            note=f"m ± s: mean and sample standard deviation (n−1) over the finished runs of "
            f"each row (runs), averaged over {', '.join(over)}; one run: no ±.",
        )
    drawn = [s if (s or {}).get("status") != "changed" else None for s in statuses]
    outputs["plot"] = plot_curves(spec, points, drawn, out_dir / "curves.png")
    return outputs


# ---- W&B -----------------------------------------------------------------------------------
def wandb_sweep_config(
    spec: dict[str, Any], runs_dir: Path, wandb_mode: str, extra: list[str]
) -> dict[str, Any]:
    return {
        "name": spec["name"],
        "method": "grid",
        "metric": {"name": "val/bleu", "goal": "maximize"},
        "parameters": {
            axis: {"values": [str(v) for v in values]} for axis, values in spec["axes"].items()
        },
        "command": [
            "${env}",
            "${interpreter}",
            "-m",
            "macformer_lit",
            "sweep",
            str(Path(spec["path"]).resolve()),
            "--runs_dir",
            str(runs_dir.resolve()),
            "--wandb_mode",
            wandb_mode,
            "--point",
            "${args}",
            *(["--", *extra] if extra else []),
        ],
    }


def parse_point(spec: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """``--axis=label`` / ``--axis label`` pairs (as a W&B agent passes them) → a point."""
    point: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise SweepError(f"--point: expected --<axis>=<label>, got {tok!r}")
        if "=" in tok:
            axis, label = tok[2:].split("=", 1)
        elif i + 1 < len(tokens):
            axis, label = tok[2:], tokens[i + 1]
            i += 1
        else:
            raise SweepError(f"--point: {tok} has no label")
        point[axis] = label
        i += 1
    axes = spec["axes"]
    unknown = sorted(set(point) - set(axes))
    if unknown:
        raise SweepError(f"--point: unknown axis {', '.join(unknown)}; axes: {', '.join(axes)}")
    missing = [a for a in axes if a not in point]
    if missing:
        raise SweepError(f"--point: no label for axis {', '.join(missing)}")
    for axis, label in point.items():
        labels = [str(v) for v in axes[axis]]
        if label not in labels:
            raise SweepError(
                f"--point: {axis}={label} is not a label of {axis} ({', '.join(labels)})"
            )
    return {a: point[a] for a in axes}


# ---- command line --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="macformer_lit sweep",
        # Axis names arrive as unknown --<axis>=<label> options: never read them as prefixes.
        allow_abbrev=False,
        description="Run a grid of macformer_lit runs from a sweep file, then tabulate and plot "
        "them. Arguments after '--' go to every run.",
    )
    p.add_argument("sweep_file", help="YAML sweep file (see configs/sweeps/)")
    p.add_argument("--runs_dir", default="runs", help="root of all runs (default: runs)")
    p.add_argument(
        "--wandb_mode", default="auto", choices=["auto", "online", "offline", "disabled"]
    )
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report_only", action="store_true", help="only write the table and plot")
    p.add_argument("--no_retry_failed", action="store_true", help="do not rerun failed points")
    p.add_argument(
        "--no_rerun_changed",
        action="store_true",
        help="refuse, rather than run again into a new version, a point whose run is done "
        "with other settings than the sweep file's now",
    )
    p.add_argument("--wandb_sweep", metavar="OUT.yaml", help="write a W&B sweep config and exit")
    p.add_argument(
        "--point",
        action="store_true",
        help="run one point given as --<axis>=<label> ... (used by W&B agents)",
    )
    return p


def _interrupted(signum: int, argv: list[str], sweep_dir: Path) -> int:
    """One line with the command that goes on where the sweep stopped; 128 + the signal."""
    from macformer_lit import interrupts

    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {locks.LOCK_FILE}:
        shutil.rmtree(sweep_dir, ignore_errors=True)  # nothing ran: no folder left behind
    again = shlex.join(["python", "-m", "macformer_lit", "sweep", *argv])
    name = interrupts.NAMES.get(signum, f"signal {signum}")
    print(
        f"macformer_lit sweep: interrupted ({name}); the point that was running saved what it "
        f"could; go on with: {again}",
        file=sys.stderr,
        flush=True,
    )
    return interrupts.exit_code(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exits with status 2 on a bad sweep file, 1 if any run failed."""
    code = _main(argv)
    if code:
        raise SystemExit(code)
    return 0


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given = list(argv)  # for the command that goes on after an interruption
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args, rest = build_parser().parse_known_args(argv)
    try:
        spec = load_sweep(args.sweep_file)
        runs_dir = Path(args.runs_dir)
        if args.wandb_sweep:
            config = wandb_sweep_config(spec, runs_dir, args.wandb_mode, extra)
            Path(args.wandb_sweep).write_text(yaml.safe_dump(config, sort_keys=False))
            print(
                f"W&B sweep config: {args.wandb_sweep}\n  wandb sweep {args.wandb_sweep}  "
                "# then: wandb agent <sweep id>"
            )
            return 0
        if args.point:
            points = [parse_point(spec, rest)]
        elif rest:
            raise SweepError(
                f"unrecognised arguments: {' '.join(rest)} (overrides for every run go after '--')"
            )
        else:
            points = grid(spec)
    except SweepError as err:
        print(f"macformer_lit sweep: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for point in points:
            print(
                shlex.join(
                    run_command(
                        spec, point, runs_dir=runs_dir, wandb_mode=args.wandb_mode, extra=extra
                    )
                )
            )
        return 0
    how = {"runs_dir": runs_dir, "wandb_mode": args.wandb_mode, "extra": extra}
    try:
        # Every point's settings, before any runs: a run is done only with the same ones.
        resolved = resolve_points(spec, grid(spec), **how)
    except SweepError as err:
        if not args.report_only:
            print(f"macformer_lit sweep: error: {err}; nothing was run", file=sys.stderr)
            return 2
        print(f"macformer_lit sweep: warning: {err}; runs tabled unchecked", file=sys.stderr)
        resolved = None
    failed = 0
    if not args.report_only:
        sweep_dir = runs_dir / spec["name"]
        try:
            # One whole-grid sweep at a time; --point agents lock their point only.
            if not args.point:
                locks.note(locks.hold(sweep_dir, "sweep"))
        except locks.FolderInUse as err:
            print(f"macformer_lit sweep: error: {err.code}", file=sys.stderr)
            return 2
        try:
            for i, point in enumerate(points, 1):
                status = run_point(
                    spec,
                    point,
                    **how,
                    retry_failed=not args.no_retry_failed,
                    label=f"[{i}/{len(points)}] ",
                    settings=resolved.get(point_name(point)),
                    rerun_changed=not args.no_rerun_changed,
                )
                failed += status.get("status") != "done"
        except SweepInterrupted as err:
            return _interrupted(err.signum, given, sweep_dir)
        finally:
            locks.release(sweep_dir)
    outputs = report(spec, runs_dir, resolved)
    print("\n".join(f"{k}: {v}" for k, v in outputs.items()))
    print((outputs["markdown"]).read_text())
    if failed:
        print(
            f"{failed} of {len(points)} point(s) not done; see the table and each point's "
            f"{LOG_FILE}"
        )
    return 1 if failed else 0
