"""Checkpoints for the CLI: find, check, load (safely) and compare with the command line.

- ``resolve_ckpt_path``: ``--ckpt_path last`` / ``best`` name the newest checkpoint of that
  kind among the experiment's ``version_<n>`` folders, for every subcommand; ``test``,
  ``validate`` and ``predict`` refuse to run without a checkpoint (they would score
  random weights).
- ``load_checkpoint``: the one way a checkpoint is read, with ``weights_only=True`` unless
  the user lifted it (``--weights_only false``). A path that is missing, a folder, not a
  torch checkpoint, or truncated gets one line saying so; only a real torch checkpoint
  that holds Python objects is told about ``--weights_only false``. ``SafeCheckpointIO``
  routes Lightning's own loads (``fit`` resume, ``test`` right after ``fit``) through it.
- ``check_fits``: LightningCLI would load a checkpoint's saved hyper-parameters over the
  command line's (a softmax checkpoint silently turned ``--config attention/rmfa_exp.yaml``
  into a softmax run, in a folder named after RMFA). Instead the model is built from what
  the command line asks for, and every setting the checkpoint contradicts is refused,
  naming both values. A ``fit`` from a checkpoint is a resume: besides the model, its
  whole config is compared with the config the checkpoint trained with (``resume_changes``):
  a setting that changes what is trained is refused, one that may change (a later
  ``max_steps``, logging, devices, observing callbacks) is returned to be recorded, and a
  ``max_steps`` the checkpoint has reached is refused (docs/architecture.md §6).
- ``open_ckpt_path``: all of the above for one run's ``--ckpt_path``, before anything is
  built (``AskedCheckpoint``: the checkpoint, this run's config, the changes a resume
  records, and the folder a ``fit --ckpt_path last`` goes on in).
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from macformer_lit import moved_keys, provenance, yamlio
from macformer_lit.attention.spec import full_spec
from macformer_lit.callbacks.preemption import AtomicCheckpointIO
from macformer_lit.runs import versions
from macformer_lit.tasks.compat import STRUCTURAL

EVAL_SUBCOMMANDS = ("validate", "test", "predict")
# A resumed fit restores the checkpoint's optimiser and schedule, whose learning rate,
# betas, eps, weight decay and warm-up would silently win over the command line's.
OPTIMIZER_SETTINGS = ("lr", "weight_decay", "betas", "eps", "warmup_steps")
# Model settings the CLI links from the DataModule: known only once the data is built.
DATA_LINKED = ("vocab_size", "num_classes", "max_len", "pad_id", "bos_id", "eos_id")
ROLES = ("encoder_attention", "decoder_attention", "cross_attention")

ZIP_MAGIC = b"PK\x03\x04"
# torch.save's legacy (non-zip) format starts with this pickled magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


class CheckpointError(ValueError):
    """A checkpoint the run cannot use; the message is one line naming problem and fix."""


# ---- finding ---------------------------------------------------------------------------
def newest_checkpoint(exp_dir: Path, which: str) -> Path | None:
    """``checkpoints/last.ckpt`` (``which="last"``) or the ``best-*.ckpt``
    (``which="best"``) of the newest version folder that holds one."""
    for _, version in versions(exp_dir):
        folder = version / "checkpoints"
        if which == "last":
            if (folder / "last.ckpt").is_file():
                return folder / "last.ckpt"
            continue
        best = sorted(folder.glob("best*.ckpt"))
        if len(best) > 1:
            raise CheckpointError(
                f"--ckpt_path best: {folder} holds {len(best)} best checkpoints "
                f"({', '.join(p.name for p in best)}); name the one to use with --ckpt_path PATH"
            )
        if best:
            return best[0]
    return None


def resolve_ckpt_path(subcommand: str, value: str | None, exp_dir: Path) -> Path | None:
    """The checkpoint file ``--ckpt_path value`` names for ``subcommand``, checked.

    ``fit --ckpt_path last`` with nothing to resume returns None (a new run starts).
    """
    if value in (None, ""):
        if subcommand in EVAL_SUBCOMMANDS:
            raise CheckpointError(
                f"{subcommand} needs a trained model: name its checkpoint with --ckpt_path "
                f"PATH (a .ckpt file), or --ckpt_path last / best for the newest run of "
                f"experiment '{exp_dir.name}' under {exp_dir.parent}"
            )
        return None
    if value in ("last", "best"):
        if subcommand == "fit" and value == "best":
            raise CheckpointError(
                "fit --ckpt_path best: fit resumes a run from its last.ckpt; use "
                "--ckpt_path last, or name a checkpoint file to start from"
            )
        found = newest_checkpoint(exp_dir, value)
        if found is None and subcommand != "fit":
            name = "last.ckpt" if value == "last" else "best-*.ckpt"
            raise CheckpointError(
                f"--ckpt_path {value}: no version_<n>/checkpoints/{name} under {exp_dir}; "
                f"name a checkpoint file, or the --experiment (and --runs_dir) its fit used"
            )
        if found is not None:
            check_checkpoint_file(found)
        return found
    path = Path(value).expanduser()
    check_checkpoint_file(path)
    return path


# ---- checking and loading --------------------------------------------------------------
def check_checkpoint_file(path: Path, option: str = "--ckpt_path") -> None:
    """One line for a path that cannot be a checkpoint file: missing, a folder, unreadable."""
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            near = sorted(p.name for p in path.parent.glob("*.ckpt"))[:5]
            if near:
                hint = f" ({path.parent} holds {', '.join(near)})"
        raise CheckpointError(
            f"{option} {path}: no such file{hint}; name an existing .ckpt file, or use "
            f"'last' / 'best' for the newest run of the experiment"
        )
    if path.is_dir():
        inside = sorted(str(p.relative_to(path)) for p in path.rglob("*.ckpt"))[:5]
        hint = f"; it holds {', '.join(inside)}" if inside else ""
        raise CheckpointError(
            f"{option} {path} is a folder, not a checkpoint file{hint}; name a .ckpt file "
            f"(e.g. .../checkpoints/last.ckpt)"
        )
    if not os.access(path, os.R_OK):
        raise CheckpointError(
            f"{option} {path}: permission denied; make the file readable or name another"
        )


def _kind(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(len(LEGACY_MAGIC))
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head == LEGACY_MAGIC:
        return "legacy"
    return "other"


def load_checkpoint(
    path: str | Path,
    *,
    weights_only: bool = True,
    mmap: bool = False,
    map_location: Any = "cpu",
    option: str = "--ckpt_path",
) -> dict[str, Any]:
    """Read a Lightning checkpoint; every failure is a one-line ``CheckpointError``.

    ``mmap=True`` reads the structure without the tensors' bytes (zip checkpoints).
    """
    path = Path(path)
    check_checkpoint_file(path, option)
    kind = _kind(path)
    if kind == "other":
        size = path.stat().st_size
        what = "an empty file" if size == 0 else "not a torch checkpoint"
        raise CheckpointError(
            f"{option} {path} is {what} (a checkpoint is a file torch.save wrote, e.g. "
            f"runs/<experiment>/version_<n>/checkpoints/last.ckpt); name a .ckpt file"
        )
    try:
        loaded = torch.load(
            path, map_location=map_location, weights_only=weights_only, mmap=mmap and kind == "zip"
        )
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if weights_only and refused:
            raise CheckpointError(
                f"{option} {path} holds a Python object ({refused.group(1)}) that loading "
                f"with weights_only=True refuses to unpickle; if you trust this file, "
                f"--weights_only false loads it"
            ) from None
        raise _damaged(path, option, err) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise _damaged(path, option, err) from None
    if not isinstance(loaded, Mapping) or "state_dict" not in loaded:
        what = type(loaded).__name__
        if isinstance(loaded, Mapping):
            what = f"a dict with keys {', '.join(map(str, list(loaded)[:6]))}"
        raise CheckpointError(
            f"{option} {path} is a torch file but not a Lightning checkpoint (it holds "
            f"{what}, no state_dict); name a .ckpt file a fit wrote"
        )
    return dict(loaded)


def _damaged(path: Path, option: str, err: BaseException) -> CheckpointError:
    text = str(err)
    if "not in a subdirectory" in text:
        return CheckpointError(
            f"{option} {path} is a zip archive but not a torch checkpoint; name a .ckpt file"
        )
    if "central directory" in text or isinstance(err, EOFError) or "Ran out of input" in text:
        reason = "its end is missing"
    else:
        reason = text.strip().splitlines()[0][:120] if text.strip() else type(err).__name__
    return CheckpointError(
        f"{option} {path} is truncated or damaged ({reason}); it cannot be loaded: use "
        f"another checkpoint (last.ckpt and the best-step file are saved side by side)"
    )


class SafeCheckpointIO(AtomicCheckpointIO):
    """Atomic saves, and every load Lightning makes (``fit`` resume, ``test`` right after
    ``fit``, ``validate``/``test``/``predict``) through ``load_checkpoint``: with
    ``weights_only=True`` unless this run was started with ``--weights_only false``."""

    def __init__(self, weights_only: bool = True) -> None:
        super().__init__()
        self.weights_only = weights_only

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        # Lightning passes None when its caller did not choose: our default, not its False.
        safe = self.weights_only if weights_only is None else weights_only
        return load_checkpoint(
            path,
            weights_only=safe,
            map_location=map_location if map_location is not None else "cpu",
        )


# ---- comparing with the command line ---------------------------------------------------
def _plain(value: Any) -> Any:
    """Namespaces and mappings as dicts, sequences as tuples, recursively."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(_plain(v) for v in value)
    return value


def full_attention_spec(spec: Any) -> dict[str, Any]:
    """``spec`` with every option it leaves out set to its default, so that
    ``{name: softmax}`` equals ``{name: softmax, dropout: 0.0}``: the complete value of
    ``attention.parse_spec`` (``ParsedSpec.full``), or the spec as given if it does not parse."""
    return full_spec(_plain(spec))


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) and not value.isidentifier() else str(value)


def _attention_problems(key: str, saved: Any, run: Any) -> list[str]:
    saved_full, run_full = full_attention_spec(saved), full_attention_spec(run)
    if saved_full == run_full:
        return []
    if saved_full.get("name") != run_full.get("name"):
        shown_saved = _plain(saved) or {"name": "softmax"}
        shown_run = _plain(run) or {"name": "softmax"}
        return [f"{key}: checkpoint has {_show(shown_saved)}, this run {_show(shown_run)}"]
    return [
        f"{key}.{opt}: checkpoint has {_show(saved_full.get(opt))}, this run "
        f"{_show(run_full.get(opt))}"
        for opt in sorted(set(saved_full) | set(run_full), key=str)
        if saved_full.get(opt) != run_full.get(opt)
    ]


def conflicts(
    saved: Mapping[str, Any],
    run: Mapping[str, Any],
    *,
    subcommand: str,
    run_class_path: str | None = None,
) -> list[str]:
    """Each setting of ``run`` (the model's init args this run asks for) that the
    checkpoint's saved hyper-parameters contradict, as ``key: checkpoint has A, this run B``.

    Settings ``run`` lacks are not compared (the data-linked ones before the data exists).
    """
    saved, run = _plain(dict(saved)), _plain(dict(run))
    problems = []
    saved_class = saved.get("_class_path")
    if saved_class and run_class_path and saved_class != run_class_path:
        return [f"model class: checkpoint has {saved_class}, this run {run_class_path}"]
    keys = list(STRUCTURAL)
    if subcommand == "fit":
        keys += OPTIMIZER_SETTINGS
    for key in keys:
        if key not in saved or key not in run:
            continue
        if "attention" in key:
            saved_spec, run_spec = saved[key], run[key]
            if key in ROLES:
                # None means "as attention" for a decoder role.
                saved_spec = saved_spec or saved.get("attention")
                run_spec = run_spec or run.get("attention")
            problems += _attention_problems(key, saved_spec, run_spec)
        elif saved[key] != run[key]:
            problems.append(
                f"{key}: checkpoint has {_show(saved[key])}, this run {_show(run[key])}"
            )
    return problems


# ---- a resumed fit against the config it trained with -------------------------------------
# Settings a resume may change, as they do not change what is trained: recorded as a dated
# change in provenance.yaml. Limits: the checkpoint's step is checked against them
# (``check_steps``); devices: an elastic resume (the data order follows the world size);
# validation, logging, display and observing callbacks; where the data lives and how many
# processes load it (the sampler, not the workers, orders it). Every other setting is refused.
RESUME_MAY_CHANGE = (
    "data.init_args.data_dir",
    "data.init_args.num_workers",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_time",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
    "trainer.num_sanity_val_steps",
    "trainer.logger",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.enable_checkpointing",
    "trainer.profiler",
    "test_after_fit",
    "weights_only",
    "wandb_mode",
    "wandb_project",
    # The standard callbacks that only observe or keep the run; not nan_guard (skip changes
    # the steps), redraw, nor rng_states (restoring the RNG states changes the draws).
    *(
        f"callbacks.{k}"
        for k in (
            *("memory", "telemetry", "best_checkpoint", "last_checkpoint", "save_on_sigterm"),
            *("metrics_rows", "lr_monitor", "throughput"),
        )
    ),
)
# Where the run is and what it resumes: never compared.
RESUME_NOT_COMPARED = ("ckpt_path", "experiment", "runs_dir", "trainer.default_root_dir", "config")
# trainer.callbacks that only observe; a change among the others is refused.
OBSERVING_CALLBACKS = {
    "LearningRateMonitor",
    "DeviceStatsMonitor",
    "ModelSummary",
    "RichModelSummary",
    "TQDMProgressBar",
    "RichProgressBar",
    "ModelCheckpoint",
    "ThroughputMemoryMonitor",
}


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the mappings in ``config``; lists are values (``betas``, devices)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name))
        else:
            out[name] = _plain(value)
    return out


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _acting_callbacks(value: Any) -> Any:
    """``trainer.callbacks`` without those that only observe."""
    if not isinstance(value, tuple):
        value = () if value is None else (value,)
    return tuple(
        c
        for c in value
        if not (
            isinstance(c, Mapping)
            and str(c.get("class_path", "")).rsplit(".", 1)[-1] in OBSERVING_CALLBACKS
        )
    )


def resume_changes(
    saved: Mapping[str, Any], run: Mapping[str, Any], *, skip: Sequence[str] = ()
) -> tuple[list[str], list[dict[str, Any]]]:
    """``saved`` (the config the checkpoint trained with) against ``run`` (this command's):
    the refused differences as ``key: checkpoint has A, this run B``, and the allowed ones
    as ``{key, old, new}``. Keys one side lacks (an option added or removed since) and the
    keys in ``skip`` (compared elsewhere) are not compared."""
    old, new = flatten_config(saved), flatten_config(run)
    # An entry of the callbacks group false on one side and its settings on the other: once
    # flattened they share no key, so compare them whole.
    saved_group, run_group = _callbacks_group(saved), _callbacks_group(run)
    for name in set(saved_group) & set(run_group):
        a, b = saved_group[name], run_group[name]
        if isinstance(a, Mapping) != isinstance(b, Mapping):
            old[f"callbacks.{name}"], new[f"callbacks.{name}"] = _plain(a), _plain(b)
    refused, allowed = [], []
    for key in sorted(set(old) & set(new)):
        if _under(key, RESUME_NOT_COMPARED) or key in skip or old[key] == new[key]:
            continue
        change = {"key": key, "old": old[key], "new": new[key]}
        if key == "trainer.callbacks":
            ok = _acting_callbacks(old[key]) == _acting_callbacks(new[key])
        else:
            ok = _under(key, RESUME_MAY_CHANGE)
        if ok:
            allowed.append(change)
        else:
            refused.append(f"{key}: checkpoint has {_show(old[key])}, this run {_show(new[key])}")
    return refused, [_yaml_ready(c) for c in allowed]


def _callbacks_group(config: Mapping[str, Any]) -> Mapping[str, Any]:
    group = config.get("callbacks")
    return group if isinstance(group, Mapping) else {}


def _yaml_ready(change: dict[str, Any]) -> dict[str, Any]:
    def plain(v):
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    return {k: plain(v) for k, v in change.items()}


def _tested(run_dir: Path) -> bool:
    """Whether the run folder's ``metrics.csv`` holds a test result (a cut file counts as
    tested: the resume is then refused, not guessed)."""
    from macformer_lit.metrics_file import MetricsFileError, read_metrics_rows

    metrics = run_dir / "metrics.csv"
    try:
        rows = read_metrics_rows(metrics) if metrics.is_file() else []
    except (MetricsFileError, OSError):
        return True
    return any(v for row in rows for k, v in row.items() if k.startswith("test/"))


def check_steps(path: Path, checkpoint: Mapping[str, Any], run: Mapping[str, Any]) -> str | None:
    """Refuse a fit whose ``max_steps`` (or, without one, ``max_epochs``) the checkpoint has
    already reached: Lightning would train nothing and exit as if it had. One case goes on,
    said in the returned note: training reached exactly its ``max_steps`` but the test after
    fit never completed (killed or failed), so that test is all the command has left to do
    (a sweep retrying the point relies on it)."""
    trainer = run.get("trainer") or {}
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    limit = None
    if isinstance(max_steps, int) and max_steps >= 0 and isinstance(step, int):
        if max_steps <= step:
            limit = ("max_steps", max_steps, "step", step)
    elif isinstance(max_epochs, int) and max_epochs >= 0 and isinstance(epoch, int):
        if max_epochs <= epoch:
            limit = ("max_epochs", max_epochs, "epoch", epoch)
    if limit is None:
        return None
    name, value, unit, reached = limit
    if value == reached and run.get("test_after_fit") and not _tested(path.parent.parent):
        return (
            f"the checkpoint {path} is at {unit} {reached}, this fit's {name}: training is "
            "finished and its test after fit never completed, so only that test runs"
        )
    raise CheckpointError(
        f"--trainer.{name} {value}: the checkpoint {path} is at {unit} {reached} already, so "
        f"this fit would train nothing; to train on, pass --trainer.{name} above {reached}; "
        f"to score it, run test with --ckpt_path {path}"
    )


def check_fits(
    path: Path,
    checkpoint: Mapping[str, Any],
    run: Mapping[str, Any],
    *,
    subcommand: str,
    run_class_path: str | None = None,
    saved_config: Mapping[str, Any] | None = None,
    run_config: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Refuse a checkpoint whose saved settings contradict this run's, naming both values.

    For a ``fit`` given both configs (the one the checkpoint trained with and this run's,
    as plain mappings), also refuse every other setting that changes what is trained, and
    a ``max_steps`` already reached; return the allowed changes, to be recorded.
    """
    saved = checkpoint.get("hyper_parameters") or {}
    problems = conflicts(saved, run, subcommand=subcommand, run_class_path=run_class_path)
    changes: list[dict[str, Any]] = []
    resume = subcommand == "fit" and saved_config is not None and run_config is not None
    if resume:
        # Model options the hyper-parameters compared keep their short names there.
        compared = [f"model.init_args.{k}" for k in _compared_keys(saved, run, subcommand)]
        refused, changes = resume_changes(saved_config, run_config, skip=compared)
        problems += refused
    if problems:
        _refuse(path, problems, subcommand=subcommand)
    if subcommand == "fit" and run_config is not None:
        note = check_steps(path, checkpoint, run_config)
        if note and rank_zero_only.rank == 0:  # DDP's other ranks parse the same command
            print(f"macformer_lit: note: {note}", flush=True)
    return changes


def _compared_keys(saved: Mapping[str, Any], run: Mapping[str, Any], subcommand: str) -> list:
    keys = list(STRUCTURAL) + (list(OPTIMIZER_SETTINGS) if subcommand == "fit" else [])
    return [k for k in keys if k in saved and k in run]


def _refuse(path: Path, problems: list[str], *, subcommand: str) -> None:
    config = path.parent.parent / "config.yaml"
    where = f" (they are in {config})" if config.is_file() else ""
    keys = [p.split(":")[0] for p in problems]
    if subcommand == "fit":
        why = "a resume continues the same training"
        if any(k in OPTIMIZER_SETTINGS for k in keys):
            why += ", with the checkpoint's optimiser and learning-rate schedule"
        raise CheckpointError(
            f"this resume would change what is trained (--ckpt_path {path}): "
            + "; ".join(problems)
            + f". {why[0].upper()}{why[1:]}: resume with the settings it trained with{where}, "
            "or leave out --ckpt_path to start a new run with these settings"
        )
    hint = f"run with the settings it was trained with{where}"
    if any(k in DATA_LINKED for k in keys):
        hint += (
            "; the data side differs (vocabulary, tokenizer or max_len): use the data "
            "settings it was trained with"
        )
    raise CheckpointError(
        f"this checkpoint does not fit the model of this run (--ckpt_path {path}): "
        + "; ".join(problems)
        + f". Either {hint}, or name a checkpoint trained with this run's settings"
    )


@dataclass
class AskedCheckpoint:
    """What ``--ckpt_path`` brought to this run; all None when it named nothing."""

    path: Path | None = None
    # Structure only (mmap): the weights are read once, by the Trainer.
    contents: dict | None = None
    # This run's config as config.yaml holds it (a fit's; recorded in its checkpoints).
    run_config: dict | None = None
    # What a resume changes, for provenance.yaml.
    changes: list[dict] = field(default_factory=list)
    # The folder a ``fit --ckpt_path last`` goes on in.
    resume_dir: Path | None = None

    @property
    def info(self) -> dict | None:
        if self.path is None:
            return None
        return {"path": str(self.path), "step": self.contents.get("global_step")}

    def check_model(self, cfg, model: Any, subcommand: str) -> None:
        """The checkpoint against the model as built, data-linked sizes included."""
        if self.contents is None or not hasattr(model, "hparams"):
            return
        check_fits(Path(cfg.ckpt_path), self.contents, dict(model.hparams), subcommand=subcommand)


def open_ckpt_path(
    cfg, subcommand: str | None, exp_dir: Path, *, plain_config: Callable[[], dict]
) -> AskedCheckpoint:
    """``--ckpt_path`` resolved, loaded and compared with the command line; ``cfg.ckpt_path``
    set to what the Trainer loads (None for a ``fit --ckpt_path last`` with nothing to
    resume, which starts anew). ``plain_config``: this run's config as config.yaml holds it."""
    asked = AskedCheckpoint()
    # Our checkpoints hold only tensors and plain containers: load them without
    # unpickling arbitrary objects unless the user asks otherwise (--weights_only false).
    if "weights_only" in cfg and cfg.get("weights_only") is None:
        cfg.weights_only = True
    value = cfg.get("ckpt_path")
    resolved = resolve_ckpt_path(subcommand, value, exp_dir) if subcommand else None
    if resolved is not None:
        cfg.ckpt_path = str(resolved)
        asked.path = resolved
        asked.contents = load_checkpoint(
            resolved, weights_only=cfg.get("weights_only") is not False, mmap=True
        )
        model = cfg.get("model")
        init = model.get("init_args") if model is not None and "init_args" in model else None
        saved_config = None
        if subcommand == "fit":
            asked.run_config = plain_config()
            saved_config = saved_run_config(resolved, asked.contents)
        if init is not None:
            asked.changes = check_fits(
                resolved,
                asked.contents,
                # The data-linked sizes are known once the data is built.
                {k: v for k, v in vars(init).items() if k not in DATA_LINKED},
                subcommand=subcommand,
                run_class_path=model.get("class_path"),
                saved_config=saved_config,
                run_config=asked.run_config,
            )
    elif subcommand == "fit":
        asked.run_config = plain_config()
    if subcommand == "fit" and value == "last":
        found = None if resolved is None else resolved.parent.parent
        if found is None:
            rank_zero_info(f"--ckpt_path last: nothing to resume under {exp_dir}; starting anew")
            cfg.ckpt_path = None
        else:
            asked.resume_dir = found
            cfg.ckpt_path = str(found / "checkpoints" / "last.ckpt")
            rank_zero_info(f"Resuming from {cfg.ckpt_path}")
    return asked


def saved_run_config(ckpt: Path, checkpoint: Mapping[str, Any]) -> dict | None:
    """The config the checkpoint trained with: recorded in it, else its run folder's
    ``config.yaml`` with the changes its resumes recorded; None when neither exists."""
    recorded = checkpoint.get(provenance.CHECKPOINT_KEY)
    if isinstance(recorded, dict) and isinstance(recorded.get("config"), dict):
        # One recorded before keys moved holds them at their old place.
        return moved_keys.migrate_config(recorded["config"])[0]
    folder = ckpt.parent.parent
    try:
        config = yamlio.load_file(folder / "config.yaml")
        entries = provenance.read(folder)
    except (OSError, yaml.YAMLError, UnicodeDecodeError, provenance.RecordError):
        config = None
    if not isinstance(config, dict):
        rank_zero_info(
            f"--ckpt_path {ckpt}: no config recorded with it or beside it; only its model "
            "settings are compared with this run's"
        )
        return None
    return provenance.effective_config(config, entries)
