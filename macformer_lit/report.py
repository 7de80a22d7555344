"""``python -m macformer_lit report RUN_DIRS... [--out DIR]``: the papers' Table 2 from our runs.

Reads run folders (each holding the ``config.yaml`` and ``metrics.csv`` the CLI writes; a
parent folder is searched recursively) and writes to ``--out``:

- ``report.md``, ``report.csv``: per task and attention setting, test accuracy (mean ±
  sample standard deviation, n-1, over distinct seeds, and the number of seeds); training
  time and peak memory relative to the softmax row with the same settings (absolute values
  in the softmax row); CPU or GPU; and the attention telemetry at the end of training: NMSE
  against the exact kernel (the last logged ``telemetry/layer*/nmse``, mean over layers)
  beside uniform attention's (``nmse_uniform``); the device names and commits the runs'
  ``provenance.yaml`` records. With ``--lra_table`` (on by default when
  an LRA task was run): the papers' ListOps numbers beside ours, and a row with its command
  for each LRA task not run. Every folder not counted is listed under "Skipped" with why.
- ``report.png``: test accuracy against relative training time.
- ``curves.png``: validation accuracy over training steps, per setting the mean over seeds
  as a line and their min–max as a band.
- ``telemetry.png``: per setting that logged telemetry, over training steps: NMSE against
  exact, NMSE of uniform attention (log scale), and the logit range.

Only finished fits count: a ``test/acc`` logged after training reached the configured
``trainer.max_steps`` (or ``max_epochs``). Runs group by their whole config except the seeds
and run bookkeeping (names, paths, W&B, loggers, what is measured or displayed), so runs of
different data or tokenizers never average together; of two runs of one seed in a group,
the later in path order is kept. Runs whose records (``provenance.yaml``) differ in code,
versions, precision or world size are not averaged unless ``--allow_mixed``
(docs/architecture.md §6); a resume's recorded changes apply over ``config.yaml``. Time is
``train/time_sec`` (training steps only); memory is peak GPU memory on GPU runs, peak
process RSS on CPU runs, and the table says which.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from macformer_lit import moved_keys, provenance, yamlio
from macformer_lit.metrics_file import MetricsFileError, read_metrics_rows
from macformer_lit.plotting import colours_for, legend_below, plot_bands, pyplot

TASK_NAMES = {
    "ListOpsDataModule": "ListOps",
    "TextDataModule": "Text",
    "RetrievalDataModule": "Retrieval",
    "ImageDataModule": "Image",
    "PathfinderDataModule": "Pathfinder",
}
LRA_CONFIGS = {
    "ListOps": "lra_listops.yaml",
    "Text": "lra_text.yaml",
    "Retrieval": "lra_retrieval.yaml",
    "Image": "lra_image.yaml",
    "Pathfinder": "lra_pathfinder.yaml",
}
MACFORMER_CONFIG = "attention/rmfa_exp.yaml"
# Test accuracy (%) on LRA ListOps (trees of 500-2000 tokens) as the papers report it.
PAPER_LISTOPS = [
    ("Macformer paper", "Transformer (softmax)", 37.30),
    ("Macformer paper", "Macformer_exp (RMFA exp + ppSBN)", 38.36),
    ("SchoenbAt paper", "SchoenbAt", 38.21),
    ("LRA paper", "Transformer (softmax)", 36.37),
    ("xformers", "Transformer, 2 layers, softmax", 37.5),
]
SEED_KEYS = ("seed_everything", "data.init_args.seed")
# Run bookkeeping: names, paths, W&B, loggers, and what is measured or displayed; none of it
# changes what is trained.
BOOKKEEPING = (
    "experiment",
    "runs_dir",
    "ckpt_path",
    "weights_only",
    "test_after_fit",
    "wandb_mode",
    "wandb_project",
    "trainer.logger",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    # The standard callbacks that only observe or keep the run (not nan_guard, redraw).
    *(f"callbacks.{k}" for k in ("memory", "telemetry", *moved_keys.FLAGS)),
)
ATTENTION_PREFIX = "model.init_args.attention"
# Attention options the row's label already shows.
LABELLED = {f"{ATTENTION_PREFIX}.{k}" for k in ("name", "kernel", "pre_sbn", "post_sbn")}
CSV_FIELDS = [
    "task",
    "backend",
    "setting",
    "status",
    "seeds",
    "seed_values",
    "test_acc",
    "test_acc_std",
    "time_sec",
    "time_rel",
    "peak_mem_mb",
    "mem_rel",
    "mem_kind",
    "device",
    "machine",
    "commit",
    "softmax_time_sec",
    "softmax_peak_mem_mb",
    "nmse",
    "nmse_uniform",
    "nmse_own",
    "nmse_uniform_own",
    "runs",
    "mixed",
    "command",
    "macformer_command",
]

Series = list[tuple[float, float]]


class Skip(Exception):
    """A folder that is not counted; the message says why."""


@dataclass
class Run:
    path: Path
    task: str
    backend: str
    seed: tuple
    settings: dict[str, str]
    test_acc: float
    time_sec: float | None
    peak_mem_mb: float | None
    mem_kind: str
    nmse: float | None = None
    nmse_uniform: float | None = None
    nmse_own: float | None = None  # against the kernel the backend computes exactly
    nmse_uniform_own: float | None = None
    val_acc: Series = field(default_factory=list)
    telemetry: dict[str, Series] = field(default_factory=dict)
    val_majority: float | None = None  # the validation split's majority-class share
    record: dict[str, str] = field(default_factory=dict)  # provenance.summary of the run


def backend_label(attention: dict | None) -> str:
    """``softmax``, ``rmfa[exp]+ppSBN``, ``favor+pre`` ... from a model's attention spec."""
    spec = dict(attention or {"name": "softmax"})
    label = spec.get("name", "softmax")
    if spec.get("kernel"):
        label += f"[{spec['kernel']}]"
    pre, post = bool(spec.get("pre_sbn")), bool(spec.get("post_sbn"))
    if pre and post:
        label += "+ppSBN"
    elif pre or post:
        label += "+preSBN" if pre else "+postSBN"
    return label


# ---- reading one run -----------------------------------------------------------------------
def flatten(value, prefix: str = "") -> dict[str, str]:
    """Dotted keys to canonical text: ``{"data.init_args.max_len": "2000", ...}``."""
    if isinstance(value, dict) and value:
        items = value.items()
    elif isinstance(value, list) and value:
        items = enumerate(value)
    else:
        return {prefix: value if isinstance(value, str) else json.dumps(value)}
    out: dict[str, str] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def is_ignored(key: str) -> bool:
    """Seeds and bookkeeping, left out of the grouping key (callbacks: only their paths)."""
    if any(key == p or key.startswith(p + ".") for p in SEED_KEYS + BOOKKEEPING):
        return True
    if key.startswith("wandb"):
        return True
    last = key.rsplit(".", 1)[-1]
    return key.startswith("trainer.callbacks.") and last.endswith(("dir", "dirpath", "filename"))


def _number(text: str | None, where: str) -> float | None:
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise Skip(f"metrics.csv: {where} is {text!r}, not a number") from None


def _values(rows: list[dict], key: str) -> list[tuple[dict, float]]:
    return [(r, v) for r in rows if (v := _number(r.get(key), key)) is not None]


def _seed(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_config(path: Path) -> dict:
    try:
        config = yamlio.load((path / "config.yaml").read_text())
    except yamlio.DuplicateKeyError as err:
        raise Skip(yamlio.describe(err, "config.yaml")) from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise Skip(f"config.yaml is not valid YAML ({first})") from None
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        raise Skip("config.yaml is not a macformer_lit run config (no data section)")
    if not isinstance(config.get("model"), dict):
        raise Skip("config.yaml is not a macformer_lit run config (no model section)")
    return config


def read_metrics(path: Path) -> list[dict]:
    try:
        rows = read_metrics_rows(path / "metrics.csv")
    except MetricsFileError as err:  # a row cut short or mixed: its values cannot be trusted
        raise Skip(str(err)) from None
    if not rows or "step" not in rows[0]:
        raise Skip("metrics.csv has no logged rows (no 'step' column)")
    return rows


def check_finished(config: dict, rows: list[dict]) -> None:
    """Raise ``Skip`` unless a test accuracy was logged after training ran to its limit."""
    if not _values(rows, "train/loss_step") and not _values(rows, "train/time_sec"):
        raise Skip("no training steps in metrics.csv (a test-only run, or a fit that never ran)")
    tests = _values(rows, "test/acc")
    if not tests:
        raise Skip("no test/acc in metrics.csv (an interrupted fit, or --test_after_fit false)")
    last = tests[-1][0]
    # The test after a fit logs at the fit's final step and epoch.
    step = int(_number(last.get("step"), "step") or 0)
    epoch = int(_number(last.get("epoch"), "epoch") or 0)
    trainer = config.get("trainer") or {}
    max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    limits = []
    if isinstance(max_steps, int) and max_steps > 0:
        if step >= max_steps:
            return
        limits.append(f"step {step} of trainer.max_steps {max_steps}")
    if isinstance(max_epochs, int) and max_epochs > 0:
        if epoch >= max_epochs:
            return
        limits.append(f"epoch {epoch} of trainer.max_epochs {max_epochs}")
    if limits:
        raise Skip("training stopped before its limit: tested at " + ", ".join(limits))


def _telemetry(rows: list[dict]) -> tuple[dict[str, Series], dict[str, float]]:
    """Per step, over layers: mean NMSEs, min logit_min and max logit_max; and the last
    value of each layer's ``nmse`` / ``nmse_uniform`` (and ``nmse_own`` /
    ``nmse_uniform_own``, against the kernel the backend computes exactly, where logged)
    averaged over layers."""
    nmses = ("nmse", "nmse_uniform", "nmse_own", "nmse_uniform_own")
    pattern = re.compile(rf"telemetry/layer(\d+)/({'|'.join(nmses)}|logit_min|logit_max)$")
    keys = [(k, m.group(2)) for k in rows[0] if (m := pattern.match(k))]
    reduce = {q: statistics.fmean for q in nmses} | {"logit_min": min, "logit_max": max}
    series: dict[str, Series] = {q: [] for q in reduce}
    last: dict[str, dict[str, float]] = {q: {} for q in nmses}
    for row in rows:
        per: dict[str, list[float]] = {}
        for key, quantity in keys:
            value = _number(row.get(key), key)
            if value is not None:
                per.setdefault(quantity, []).append(value)
                if quantity in last:
                    last[quantity][key] = value
        step = _number(row.get("step"), "step")
        if step is None:
            continue
        for quantity, values in per.items():
            series[quantity].append((step, reduce[quantity](values)))
    final = {q: statistics.fmean(v.values()) for q, v in last.items() if v}
    return {q: s for q, s in series.items() if s}, final


def read_run(path: Path) -> Run:
    """One finished fit; ``Skip`` with the reason for anything else."""
    if not (path / "config.yaml").is_file():
        raise Skip("not a run: metrics.csv without config.yaml")
    if not (path / "metrics.csv").is_file():
        raise Skip("not a run: config.yaml without metrics.csv")
    config = read_config(path)
    try:
        entries = provenance.read(path)
    except provenance.RecordError as err:
        raise Skip(str(err)) from None
    # A resume records its changes there and leaves the first config.yaml as it was.
    config = provenance.effective_config(config, entries)
    rows = read_metrics(path)
    check_finished(config, rows)
    data_class = str(config["data"].get("class_path", "?")).rsplit(".", 1)[-1]
    model_args = config["model"].get("init_args") or {}
    data_args = config["data"].get("init_args") or {}
    attention = model_args.get("attention")
    if attention is not None and not isinstance(attention, dict):
        raise Skip(f"model.init_args.attention is {attention!r}, not a mapping")
    gpu = [v for _, v in _values(rows, "train/peak_gpu_mem_mb")]
    rss = [v for _, v in _values(rows, "train/peak_rss_mb")]
    times = [v for _, v in _values(rows, "train/time_sec")]
    telemetry, final = _telemetry(rows)
    return Run(
        path=path,
        task=TASK_NAMES.get(data_class, data_class),
        backend=backend_label(attention),
        seed=(_seed(config.get("seed_everything")), _seed(data_args.get("seed"))),
        settings={k: v for k, v in flatten(config).items() if not is_ignored(k)},
        test_acc=_values(rows, "test/acc")[-1][1],
        time_sec=max(times) if times else None,
        peak_mem_mb=max(gpu or rss) if (gpu or rss) else None,
        mem_kind="GPU" if gpu else "RSS",
        nmse=final.get("nmse"),
        nmse_uniform=final.get("nmse_uniform"),
        nmse_own=final.get("nmse_own"),
        nmse_uniform_own=final.get("nmse_uniform_own"),
        val_acc=[(float(r["step"]), v) for r, v in _values(rows, "val/acc") if r.get("step")],
        telemetry=telemetry,
        val_majority=next((v for _, v in _values(rows, "val/majority_acc")), None),
        record=provenance.summary(entries),
    )


# ---- finding and grouping runs -------------------------------------------------------------
def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(
    paths: list[Path], out: Path | None = None
) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Folders holding ``config.yaml`` or ``metrics.csv`` (not those inside another such
    folder, e.g. W&B's files), and the folders under a given path holding neither (but
    ``out``, where the report itself goes)."""
    found: list[Path] = []
    empty: list[tuple[Path, str]] = []
    for p in paths:
        if not p.exists():
            raise SystemExit(f"report: error: {p} does not exist")
        if not p.is_dir():
            empty.append((p, "not a folder"))
            continue
        marked = {f.parent for name in ("config.yaml", "metrics.csv") for f in p.rglob(name)}
        top = sorted((d for d in marked if not any(a in marked for a in d.parents)), key=_natural)
        found += top
        if p in marked:
            continue
        if not top:
            empty.append((p, "not a run: no config.yaml or metrics.csv in it or below"))
            continue
        for child in sorted(c for c in p.iterdir() if c.is_dir()):
            if out is not None and child.resolve() == out.resolve():
                continue
            if not any(d == child or child in d.parents for d in top):
                empty.append((child, "not a run: no config.yaml or metrics.csv in it or below"))
    return found, empty


def collect(paths: list[Path], out: Path | None = None) -> tuple[list[Run], list[tuple[Path, str]]]:
    """The runs that count, and every folder skipped with why."""
    folders, skipped = find_runs(paths, out)
    runs: list[Run] = []
    for folder in folders:
        try:
            runs.append(read_run(folder))
        except Skip as why:
            skipped.append((folder, str(why)))
        except OSError as err:
            skipped.append((folder, f"unreadable ({err.strerror or err})"))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            # A config of another shape (not written by this CLI): one line, no traceback.
            skipped.append((folder, f"not a run config this report reads ({err!r})"))
    # One run per seed in a group: a rerun of a seed replaces it rather than counting twice.
    kept: dict[tuple, Run] = {}
    for run in sorted(runs, key=lambda r: _natural(r.path)):
        # An unseeded run (seed_everything null) is its own seed.
        key = (group_key(run), run.seed if run.seed[0] is not None else run.path)
        if key in kept:
            skipped.append(
                (
                    kept[key].path,
                    f"same seed as {run.path}, which is counted instead (the later in path order)",
                )
            )
        kept[key] = run
    return list(kept.values()), skipped


def device_of(run: Run) -> str:
    """CPU or GPU, from the memory metric the run logged."""
    return "GPU" if run.mem_kind == "GPU" else "CPU"


def identity(run: Run) -> dict[str, str]:
    """What runs averaged together must share (``provenance.code_identity``); CUDA's version
    is compared among GPU runs only (a CPU run does not use it)."""
    ident = provenance.code_identity(run.record)
    if device_of(run) == "CPU":
        ident.pop("cuda", None)
    return ident


def _where(path: Path) -> str:
    return "/".join(path.parts[-2:])


def differences(runs: list[Run]) -> list[str]:
    """``field: value in run, value in run`` for each recorded field the runs disagree on."""
    idents = [identity(r) for r in runs]
    out = []
    for key in [k for k in idents[0] if all(k in i for i in idents[1:])]:
        holders: dict[str, list[str]] = {}
        for run, ident in zip(runs, idents):
            holders.setdefault(str(ident[key]), []).append(_where(run.path))
        if len(holders) > 1:
            out.append(
                f"{key}: " + " vs ".join(f"{v} ({' '.join(ws)})" for v, ws in holders.items())
            )
    return out


def commit_text(run: Run) -> str:
    """The run's commit(s), ``*`` where the package had uncommitted changes."""
    return run.record.get("commit", provenance.UNKNOWN) + (
        "*" if "True" in run.record.get("dirty", "") else ""
    )


def commits_text(runs: list[Run]) -> str:
    """A row's commits; ``†`` where a run recorded no digest of its code."""
    text = _distinct(commit_text(r) for r in runs)
    unknown = any(r.record.get("digest", provenance.UNKNOWN) == provenance.UNKNOWN for r in runs)
    return text + (" †" if unknown else "")


def machine_text(run: Run) -> str:
    """GPU runs: the device names; CPU runs: the CPU model and intra-op threads."""
    record = run.record
    if device_of(run) == "GPU":
        return record.get("devices", provenance.UNKNOWN)
    cpu, threads = record.get("cpu", provenance.UNKNOWN), record.get("threads", provenance.UNKNOWN)
    if cpu == provenance.UNKNOWN and threads == provenance.UNKNOWN:
        return provenance.UNKNOWN
    return f"{cpu}, {threads} thread{'' if threads == '1' else 's'}"


def _distinct(texts) -> str:
    return ", ".join(dict.fromkeys(texts))


def config_key(run: Run) -> tuple:
    """Runs of one experiment: the task and the whole config but seeds and bookkeeping."""
    return (run.task, tuple(sorted(run.settings.items())))


def group_key(run: Run) -> tuple:
    """A row: one experiment on one kind of device (times and memory compare only there)."""
    return (*config_key(run), device_of(run))


def task_key(run: Run) -> tuple:
    """The group key without the attention spec: rows that share it compare to one softmax."""
    return (
        run.task,
        tuple(
            sorted((k, v) for k, v in run.settings.items() if not k.startswith(ATTENTION_PREFIX))
        ),
        device_of(run),
    )


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _short(key: str) -> str:
    return key.replace(".init_args.", ".")


def settings_text(groups: dict[tuple, list[Run]]) -> dict[tuple, str]:
    """What tells apart rows the label does not: the non-attention settings that differ among
    a task's groups, and the attention options that differ among groups of one label."""
    out: dict[tuple, str] = {}
    for key, runs in groups.items():
        task, label = runs[0].task, runs[0].backend
        same_task = [rs[0].settings for rs in groups.values() if rs[0].task == task]
        same_label = [
            rs[0].settings for rs in groups.values() if (rs[0].task, rs[0].backend) == (task, label)
        ]
        parts = []
        for pool, attention in ((same_task, False), (same_label, True)):
            keys = sorted({k for s in pool for k in s})
            for k in keys:
                if k.startswith(ATTENTION_PREFIX) != attention or k in LABELLED:
                    continue
                if len({s.get(k) for s in pool}) > 1:
                    parts.append(f"{_short(k)}={runs[0].settings.get(k, 'unset')}")
        out[key] = ", ".join(parts)
    return out


def seed_text(seed: tuple) -> str:
    """``42``, or ``42/data7`` where the data seed is not the default 0; ``?`` unseeded."""
    everything, data = seed
    text = "?" if everything is None else str(everything)
    return text if data in (None, 0) else f"{text}/data{data}"


def summarise(runs: list[Run]) -> tuple[list[dict], dict[tuple, list[Run]]]:
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault(group_key(r), []).append(r)
    settings = settings_text(groups)
    baselines: dict[tuple, list[Run]] = {}
    # Where several softmax groups share the settings, the one with most seeds.
    for rs in sorted(groups.values(), key=len, reverse=True):
        if rs[0].backend == "softmax":
            baselines.setdefault(task_key(rs[0]), rs)
    rows = []
    for key, rs in groups.items():
        base = baselines.get(task_key(rs[0]), [])
        base_time = _mean([r.time_sec for r in base if r.time_sec])
        base_mem = _mean([r.peak_mem_mb for r in base if r.peak_mem_mb])
        accs = [100 * r.test_acc for r in rs]
        time = _mean([r.time_sec for r in rs if r.time_sec])
        mem = _mean([r.peak_mem_mb for r in rs if r.peak_mem_mb])
        rows.append(
            {
                "task": rs[0].task,
                "backend": rs[0].backend,
                "setting": settings[key],
                "status": "run",
                "seeds": len(rs),
                "seed_values": ";".join(seed_text(r.seed) for r in rs),
                "test_acc": statistics.fmean(accs),
                "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else None,
                "time_sec": time,
                "time_rel": time / base_time if time and base_time else None,
                "peak_mem_mb": mem,
                "mem_rel": mem / base_mem if mem and base_mem else None,
                "mem_kind": "/".join(sorted({r.mem_kind for r in rs})),
                "device": device_of(rs[0]),
                "machine": "; ".join(dict.fromkeys(machine_text(r) for r in rs)),
                "commit": commits_text(rs),
                "softmax_time_sec": base_time,
                "softmax_peak_mem_mb": base_mem,
                "nmse": _mean([r.nmse for r in rs if r.nmse is not None]),
                "nmse_uniform": _mean([r.nmse_uniform for r in rs if r.nmse_uniform is not None]),
                "nmse_own": _mean([r.nmse_own for r in rs if r.nmse_own is not None]),
                "nmse_uniform_own": _mean(
                    [r.nmse_uniform_own for r in rs if r.nmse_uniform_own is not None]
                ),
                "runs": ";".join(str(r.path) for r in rs),
                "_mixed": differences(rs),
                "mixed": "; ".join(differences(rs)),
                "command": None,
                "_key": key,
            }
        )
    order = list(TASK_NAMES.values())
    rows.sort(
        key=lambda r: (
            order.index(r["task"]) if r["task"] in order else len(order),
            r["task"],
            r["backend"] != "softmax",
            r["backend"],
            r["setting"],
            r["device"],
        )
    )
    return rows, groups


def not_run_rows(rows: list[dict]) -> list[dict]:
    """A row with its command for each LRA task without a counted run."""
    done = {r["task"] for r in rows}
    out = []
    for task, config in LRA_CONFIGS.items():
        if task not in done:
            command = f"python -m macformer_lit fit --config {config}"
            out.append(
                {
                    "task": task,
                    "status": "not run",
                    "seeds": 0,
                    "command": command,
                    "macformer_command": f"{command} --config {MACFORMER_CONFIG}",
                }
            )
    return out


# ---- writing -------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _own(row: dict) -> str:
    if row.get("nmse_own") is None:
        return "–"
    return f"{row['nmse_own']:.2e} / {_fmt(row.get('nmse_uniform_own'), '.2e')}"


def _acc(row: dict) -> str:
    text = _fmt(row["test_acc"], ".2f")
    return text if row.get("test_acc_std") is None else f"{text} ± {row['test_acc_std']:.2f}"


def _listops_lengths(settings: dict[str, str]) -> str:
    lo = settings.get("data.init_args.generate_min_length", "?")
    hi = settings.get("data.init_args.generate_max_length", "?")
    return f"trees {lo}–{hi} tokens"


def markdown(
    rows: list[dict],
    missing: list[dict],
    groups: dict[tuple, list[Run]],
    skipped: list[tuple[Path, str]],
    lra_table: bool,
) -> str:
    lines = [
        "| task | attention | setting | seeds | test acc (%) | time (× softmax) "
        "| peak memory (× softmax) | device | commit | NMSE vs exact | NMSE uniform "
        "| NMSE vs own kernel / uniform's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        time, mem = _fmt(r["time_rel"], ".2f"), _fmt(r["mem_rel"], ".2f")
        if r["backend"] == "softmax" and r["time_sec"] is not None:
            time += f" ({r['time_sec']:.3g} s)"
        if r["backend"] == "softmax" and r["peak_mem_mb"] is not None:
            mem += f" ({r['peak_mem_mb']:.0f} MB {r['mem_kind']})"
        else:
            mem += f" ({r['mem_kind']})"
        lines.append(
            f"| {r['task']} | {r['backend']} | {r['setting'] or '–'} | {r['seeds']} | {_acc(r)} "
            f"| {time} | {mem} | {_device_cell(r)} | {r['commit']} | {_fmt(r['nmse'], '.2e')} "
            f"| {_fmt(r['nmse_uniform'], '.2e')} | {_own(r)} |"
        )
    for r in missing:
        lines.append(
            f"| {r['task']} | – | not run: `{r['command']}` (Macformer: add "
            f"`--config {MACFORMER_CONFIG}`) | 0 | not run | – | – | – | – | – | – | – |"
        )
    lines += [
        "",
        "- test acc: mean ± sample standard deviation (n−1) over the distinct seeds counted "
        "(the seeds column); one seed: no ±.",
        "- time: training steps only (`train/time_sec`); memory: peak GPU memory, or peak "
        "process RSS on CPU runs; both relative to the softmax row with the same settings, "
        "whose absolute values are in parentheses.",
        "- device: CPU or GPU, read from the memory metric the run logged, with what the runs' "
        "`provenance.yaml` records (GPU names; CPU model and intra-op threads); commit: the "
        "commits the runs ran (`*`: with uncommitted changes to the package; unknown: not "
        "recorded; †: some runs recorded no digest of their code, as in records recovered "
        "after the run: they average only with runs that recorded none either). Runs are "
        "averaged only where their recorded code, versions, precision and world size agree "
        "(docs/architecture.md §6), unless `--allow_mixed`.",
        "- NMSE: the attention telemetry's last logged `telemetry/layer*/nmse` against the "
        "exact kernel, mean over layers (then over seeds), beside uniform attention's "
        "(`nmse_uniform`); – where the run logged no telemetry. NMSE vs own kernel: where "
        "the backend computes another kernel exactly than the one it stands for (the "
        "degree-2 Maclaurin map: a₀ + a₁s + a₂s², not exp), the same against that kernel's "
        "exact attention (`nmse_own`), and uniform attention's (`nmse_uniform_own`).",
        "- rows: runs grouped by their whole config except seeds (`seed_everything`, "
        "`data.init_args.seed`) and bookkeeping (experiment, runs_dir, ckpt_path, W&B, "
        "loggers, callback paths, telemetry, memory and standard-callback settings, progress "
        "display), and by device (CPU and GPU runs of one config are two rows, each timed "
        "against softmax on its own device); setting shows the config values in which rows "
        "of a task differ. Only "
        "fits that reached their max_steps/max_epochs and then logged test/acc count; a "
        "second run of a seed "
        "already in its group counts once (the later in path order).",
    ]
    if lra_table:
        lines += [
            "",
            "## ListOps: the papers' numbers beside ours",
            "",
            "| source | model | test acc (%) |",
            "|---|---|---|",
        ]
        lines += [f"| {src} | {model} | {acc:.2f} |" for src, model, acc in PAPER_LISTOPS]
        ours = [r for r in rows if r["task"] == "ListOps"]
        for label, setting, settings, runs in _pooled_over_devices(ours, groups):
            accs = [100 * r.test_acc for r in runs]
            pooled = {
                "test_acc": statistics.fmean(accs),
                "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else None,
            }
            devices = sorted({device_of(r) for r in runs})
            where = ""
            if len(devices) > 1:
                counts = [sum(device_of(r) == d for r in runs) for d in devices]
                where = ": " + " + ".join(f"{n} on {d}" for n, d in zip(counts, devices))
            differs = f", {setting}" if setting else ""
            lines.append(
                f"| ours | {label} ({_listops_lengths(settings)}{differs}, {len(runs)} seed"
                f"{'s' if len(runs) > 1 else ''}{where}) | {_acc(pooled)} |"
            )
        if not ours:
            lines.append(
                f"| ours | not run: `python -m macformer_lit fit --config "
                f"{LRA_CONFIGS['ListOps']}` | – |"
            )
        lines += [
            "",
            "The papers' numbers are on LRA's ListOps (trees of 500–2000 tokens, "
            "`lra_listops.yaml`); a run on other tree lengths is not comparable to them.",
        ]
    mixed = mixed_rows(rows, groups, lra_table)
    if mixed:
        lines += ["", "## Averaged with --allow_mixed", ""]
        lines += [f"- {label}: {'; '.join(diffs)}" for label, diffs in mixed]
    lines += ["", "## Skipped", ""]
    skipped = sorted(skipped, key=lambda item: _natural(item[0]))
    lines += [f"- `{p}`: {why}" for p, why in skipped] or ["None."]
    return "\n".join(lines) + "\n"


def _device_cell(row: dict) -> str:
    known = row["machine"] not in ("", provenance.UNKNOWN)
    return f"{row['device']} ({row['machine']})" if known else row["device"]


def _row_label(row: dict) -> str:
    setting = f" [{row['setting']}]" if row["setting"] else ""
    return f"{row['task']} {row['backend']}{setting} ({row['device']})"


def mixed_rows(
    rows: list[dict], groups: dict[tuple, list[Run]], lra_table: bool
) -> list[tuple[str, list[str]]]:
    """Each row (and, with the papers' table, each pooling of a config's rows over devices)
    that would average runs whose recorded code or settings differ, with the differences."""
    out = [(_row_label(r), r["_mixed"]) for r in rows if r.get("_mixed")]
    if lra_table:
        ours = [r for r in rows if r["task"] == "ListOps"]
        for label, setting, _, runs in _pooled_over_devices(ours, groups):
            if len({device_of(r) for r in runs}) > 1 and (diffs := differences(runs)):
                where = f" [{setting}]" if setting else ""
                out.append((f"ListOps {label}{where} pooled over devices", diffs))
    return out


def _pooled_over_devices(rows: list[dict], groups: dict[tuple, list[Run]]):
    """[(label, setting text, settings, runs)]: the rows of one experiment (one config) on
    different devices as one, in row order. The papers' table compares accuracy, for which
    a run on another device is one more run of the same experiment, so it pools them; times
    and memory depend on the device, so the main table keeps them apart."""
    pooled: dict[tuple, tuple[str, str, dict, list[Run]]] = {}
    for r in rows:
        runs = groups[r["_key"]]
        key = config_key(runs[0])
        if key not in pooled:
            pooled[key] = (r["backend"], r["setting"], runs[0].settings, [])
        pooled[key][3].extend(runs)
    return list(pooled.values())


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def row_name(row: dict, tasks: int) -> str:
    """A row's name in the plots: its setting with ``model.attention.`` shortened to
    ``attention.`` (no other top-level key is called that, so no two names can meet); the
    table keeps the paths whole."""
    setting = re.sub(r"(?<![\w.])model\.attention\.", "attention.", row["setting"])
    name = row["backend"] + (f" [{setting}]" if setting else "")
    name += " (GPU)" if row["device"] == "GPU" else ""
    return f"{row['task']}: {name}" if tasks > 1 else name


def row_colours(rows: list[dict]) -> dict[str, str]:
    """One colour per row name, the same in every figure of a report."""
    tasks = len({r["task"] for r in rows})
    return colours_for([row_name(r, tasks) for r in rows])


def plot_accuracy_time(rows: list[dict], path: Path) -> None:
    """Test accuracy against training time relative to softmax, a point per row that has a
    softmax row to be timed against, named in the legend under the plot."""
    plt = pyplot()
    tasks = sorted({r["task"] for r in rows})
    pts = [r for r in rows if r["time_rel"]]
    names = [row_name(r, len(tasks)) for r in pts]
    colours = row_colours(rows)
    markers = dict(zip(tasks, "osD^v<>p*h"))
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for r, name in zip(pts, names):
        ax.scatter(
            r["time_rel"], r["test_acc"], label=name, color=colours[name], marker=markers[r["task"]]
        )
    ax.set_xlabel("training time (× softmax, same settings and device)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy against training time")
    ax.grid(alpha=0.3)
    legend_below(fig, [ax], ncol=1)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_validation(rows: list[dict], groups: dict[tuple, list[Run]], path: Path) -> None:
    """Validation accuracy over steps, one panel per task; the validation split's majority
    class as a grey dashed line where the runs logged it (``val/majority_acc``)."""
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    names = {r["_key"]: row_name(r, 1) for r in rows}  # a panel per task: no task prefix
    full = row_colours(rows)
    colours = {names[r["_key"]]: full[row_name(r, len(tasks))] for r in rows}
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(7 * len(tasks), 4), squeeze=False, layout="constrained"
    )
    for ax, task in zip(axes[0], tasks):
        curves = {
            names[r["_key"]]: [[(s, 100 * v) for s, v in run.val_acc] for run in groups[r["_key"]]]
            for r in rows
            if r["task"] == task
        }
        plot_bands(ax, curves, colours=colours)
        shares = {
            run.val_majority
            for r in rows
            if r["task"] == task
            for run in groups[r["_key"]]
            if run.val_majority is not None
        }
        if shares:
            # One validation split per task, so one share (several: their range, drawn apart).
            for i, share in enumerate(sorted(shares)):
                ax.axhline(100 * share, color="grey", linestyle="--", linewidth=1.2,
                           label="majority class (validation)" if i == 0 else None)  # fmt: skip
        ax.set_title(f"{task}: validation accuracy (mean over seeds, min–max band)")
        ax.set_xlabel("training step")
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(alpha=0.3)
    legend_below(fig, axes[0], ncol=1)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_telemetry(rows: list[dict], groups: dict[tuple, list[Run]], path: Path) -> bool:
    """NMSE vs exact, NMSE of uniform attention and the logit range over steps; False (and
    no file) when no run logged telemetry."""
    tasks = len({r["task"] for r in rows})
    with_telemetry = [r for r in rows if any(run.telemetry for run in groups[r["_key"]])]
    if not with_telemetry:
        return False
    plt = pyplot()
    names = {r["_key"]: row_name(r, tasks) for r in with_telemetry}
    colours = row_colours(rows)

    def curves(quantity: str) -> dict[str, list]:
        return {
            names[r["_key"]]: [run.telemetry.get(quantity, []) for run in groups[r["_key"]]]
            for r in with_telemetry
        }

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), layout="constrained")
    plot_bands(axes[0], curves("nmse"), colours=colours, log=True)
    axes[0].set_title("NMSE against exact attention")
    plot_bands(axes[1], curves("nmse_uniform"), colours=colours, log=True)
    axes[1].set_title("NMSE of uniform attention against exact")
    plot_bands(axes[2], curves("logit_max"), colours=colours)
    dashed = {name: "--" for name in names.values()}
    plot_bands(axes[2], curves("logit_min"), colours=colours, linestyles=dashed)
    axes[2].set_title("logit range q·k/√d (max solid, min dashed)")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    fig.suptitle(
        "Attention telemetry, mean over layers (logits: min/max over layers); "
        "mean over seeds, min–max band"
    )
    legend_below(fig, axes[:1], ncol=2)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="macformer_lit report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or their parents")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="output folder")
    parser.add_argument(
        "--lra_table",
        choices=["auto", "on", "off"],
        default="auto",
        help="the papers' ListOps numbers and the LRA tasks not run (auto: when an LRA task "
        "was run)",
    )
    parser.add_argument(
        "--allow_mixed",
        action="store_true",
        help="average runs whose recorded code (commit, uncommitted changes, versions) or "
        "precision and world size differ; the table then lists each difference (default: "
        "refuse, naming them)",
    )
    args = parser.parse_args(argv)
    # Before reading any run: an --out that is a file, or cannot be made, is one line.
    from macformer_lit.preflight import UsageError, check_folder

    try:
        check_folder(args.out, "--out", write=True)
    except UsageError as err:
        print(f"report: error: {err.code}", file=sys.stderr)
        raise SystemExit(2) from None
    runs, skipped = collect(args.runs, args.out)
    if not runs:
        reasons = "".join(f"\n  {p}: {why}" for p, why in skipped)
        raise SystemExit(
            "report: error: no finished runs (folders with config.yaml and metrics.csv) under "
            + ", ".join(map(str, args.runs))
            + reasons
        )
    rows, groups = summarise(runs)
    lra = args.lra_table == "on" or (
        args.lra_table == "auto" and any(r["task"] in LRA_CONFIGS for r in rows)
    )
    missing = not_run_rows(rows) if lra else []
    mixed = mixed_rows(rows, groups, lra)
    if mixed and not args.allow_mixed:
        raise SystemExit(
            "report: error: runs whose recorded code or settings differ would be averaged: "
            + "; ".join(f"{label}: {'; '.join(diffs)}" for label, diffs in mixed)
            + ". Rerun them alike or report them apart; --allow_mixed averages them anyway "
            "and lists each difference under the table"
        )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows + missing, out / "report.csv")
    (out / "report.md").write_text(markdown(rows, missing, groups, skipped, lra), encoding="utf-8")
    plot_accuracy_time(rows, out / "report.png")
    plot_validation(rows, groups, out / "curves.png")
    written = ["report.md", "report.csv", "report.png", "curves.png"]
    if plot_telemetry(rows, groups, out / "telemetry.png"):
        written.append("telemetry.png")
    print((out / "report.md").read_text())
    print("Wrote " + ", ".join(str(out / name) for name in written))


if __name__ == "__main__":
    main()
