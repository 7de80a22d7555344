"""Checks of a command line before anything is built or written.

Each mistake a user can make on the command line or in a config file stops the run with
one line naming the problem and the fix (``UsageError``), before data is read, a model is
built or a run folder exists:

- config files: YAML syntax (file, line and column), a key given twice in one mapping, tab
  characters, an empty file or one whose top level is not a mapping (``check_config_file``);
  the same duplicate check on every YAML jsonargparse loads, inline values included
  (``install_parser_loaders``);
- a value of the wrong type or not among the choices: jsonargparse's many-line union
  report shortened to the option, the expected values and the given one
  (``short_parse_error``);
- trainer values Lightning would reject later, and a ``max_len`` whose position table
  cannot be allocated (``check_trainer_values``, ``check_model_size``);
- paths: the runs folder and the data folder (``check_folder``), experiment names
  (``check_experiment``);
- launch and environment: several nodes without a cluster launcher (``check_launch``), a
  fit with no end (``check_schedule``), seeds out of range (``check_seeds``), an inline
  mapping or list that does not parse (the loaders above), an overlay config without a task
  config (``check_task_given``), a model and data of different tasks (``check_task_data``),
  random features that cannot fit in memory (``check_feature_memory``); W&B online without
  a key is ``loggers.check_wandb_mode``.

The CLI runs them in two calls on the parsed command line: ``check_command`` right after
parsing (every check above, the attention specs parsed into values), ``check_attention``
once a checkpoint is resolved (each spec trial-built). Then ``runs.RunFolders`` takes the
run's folder. A write that fails for want of space later (a full disk while metrics are
written) is one line too (``disk_full``, in ``errors.exit_for``).
"""

from __future__ import annotations

import os
import re
import sys
import typing
from importlib import import_module
from pathlib import Path
from typing import Any

import yaml

from macformer_lit import yamlio
from macformer_lit.attention.spec import (
    ParsedSpec,
    check_attention_spec,
    parse_spec,
    spec_arguments,
)
from macformer_lit.loggers import check_wandb_mode
from macformer_lit.moved_keys import migrate_config
from macformer_lit.tasks.base import LitTask


class UsageError(SystemExit):
    """A mistake in what the user asked for; ``main`` prints it as one line, exit code 2."""


# ---- config files ------------------------------------------------------------------------
def check_config_file(path: str) -> None:
    """The file must be YAML whose top level is a mapping of settings."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"config {path}: cannot be read ({err.strerror})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent:
            raise UsageError(
                f"config {path}, line {lineno}: indented with a tab character; YAML indents "
                "with spaces only: replace the tab by spaces"
            )
    try:
        data = yamlio.load(text)
    except yaml.YAMLError as err:
        raise UsageError(yamlio.describe(err, f"config {path}")) from None
    if data is None:
        raise UsageError(
            f"config {path} is empty: a config is a mapping of settings, e.g. "
            "'trainer: {max_steps: 100}'"
        )
    if not isinstance(data, dict):
        raise UsageError(
            f"config {path} holds a {type(data).__name__} at its top level: a config is a "
            "mapping of settings, e.g. 'trainer: {max_steps: 100}'"
        )


# The command line being parsed: an inline value's error names its option.
_ARGV: list[str] = []
# Old keys the config files of the command being parsed used (moved_keys.py).
_MOVED: list[tuple[str, str]] = []


def moved_in_config_files() -> list[tuple[str, str]]:
    """The ``(old, new)`` keys the config files of this command moved, for its note."""
    return list(_MOVED)


def _option_of(value: str) -> str | None:
    for i, arg in enumerate(_ARGV):
        if arg.startswith("--") and i + 1 < len(_ARGV) and _ARGV[i + 1] == value:
            return arg
        if arg.startswith("--") and arg.endswith(f"={value}"):
            return arg.split("=", 1)[0]
    return None


def install_parser_loaders(argv: list[str] | None = None) -> None:
    """jsonargparse loads every config and inline YAML value with a loader that refuses a
    key given twice (``UsageError`` naming the file, or the value, and the line): its own
    loaders keep the last duplicate, or, for an inline mapping, take the text as a string.
    An inline value that opens a mapping or list and does not parse is refused too. A
    ``--config`` file's old callback keys are read at their new place
    (``moved_keys.migrate_config``; ``moved_in_config_files`` lists them)."""
    from jsonargparse import get_loader, set_loader

    _ARGV[:] = list(argv or [])
    _MOVED.clear()

    for mode in ("yaml", "omegaconf"):
        try:
            base = get_loader(mode)
        except KeyError:  # jsonargparse makes its omegaconf loader on first use
            try:
                from jsonargparse._optionals import get_omegaconf_loader  # no public getter
            except ImportError:
                continue
            base = get_omegaconf_loader(mode)
        if getattr(base, "refuses_duplicate_keys", False):
            continue
        set_loader(mode, _refusing_duplicates(base), (yaml.YAMLError,))


def _refusing_duplicates(base):
    def load(value: str, path: str = "") -> Any:
        one_line = " ".join(value.split()) if isinstance(value, str) else ""
        what = f"config {path}" if path else f"YAML value {one_line[:60]!r}"
        try:
            yamlio.check_unique_keys(value)
        except yamlio.DuplicateKeyError as err:
            # SystemExit: jsonargparse treats a loader's errors as "not YAML, a string".
            raise UsageError(yamlio.describe(err, what)) from None
        except yaml.YAMLError as err:
            # Text that opens a YAML mapping or list and does not parse is a typo (an
            # unclosed brace, a missing comma), not a string: jsonargparse would take it as
            # one and fail far from the cause ("unknown attention backend '{name: rmfa'").
            if not path and one_line[:1] in ("{", "["):
                option = _option_of(value)
                raise UsageError(
                    (f"{option}: " if option else "")
                    + f"{yamlio.describe(err, what)}: check its brackets, commas and quotes, and "
                    "quote the whole value for the shell"
                ) from None
            # Otherwise not YAML: jsonargparse decides what the text is, as it always did.
        loaded = base(value)
        if path and isinstance(loaded, dict):  # a --config file: its old keys move
            loaded, moves = migrate_config(loaded)
            _MOVED.extend(m for m in moves if m not in _MOVED)
        return loaded

    load.refuses_duplicate_keys = True
    return load


# ---- jsonargparse's errors -------------------------------------------------------------
_KEY = re.compile(r'^(\s*)(?:- )?(?:Parser key|Key) "([^"]+)"')
_EXPECTED = re.compile(r"^(\s*)(?:- )?Expected a (.+?)(?:\. Got value: (.*))?$")
_GIVEN = re.compile(r"^\s*Given value: (.*)$")
_NOISE = re.compile(
    r"^\s*(?:- )?(?:Does not validate against any of the Union subtypes|Subtypes:|Errors:|"
    r"Given value type:|Problem with given class_path .*:$)"
)


def _describe_type(text: str) -> str:
    text = text.strip()
    # jsonargparse's words for a class or dataclass given a plain string.
    if text.startswith("dot import path string"):
        return "a mapping or a class path"
    m = re.fullmatch(r"typing\.Literal\[(.*)\]", text)
    if m:
        return f"one of {m.group(1)}"
    m = re.fullmatch(r"<class '(?:builtins\.)?(\w+)'>", text)
    if m:
        if m.group(1) == "bool":
            return "true or false"
        name = {"dict": "mapping", "str": "string", "int": "integer", "float": "number"}
        word = name.get(m.group(1), m.group(1))
        return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"
    return text


def short_parse_error(message: str) -> str:
    """The option and what is wrong with it, from jsonargparse's report.

    jsonargparse reports a bad value below every union it passed through (``model`` may be
    any LightningModule or None, its ``attention`` a dict or None ...); the user needs the
    innermost failure only: ``data.tokenizer: expected one of 'official', 'skyformer'; got
    'foo'``, or ``seed_everything: expected true or false or an integer; got 'abc'``.
    Messages of another shape come back as their first lines, joined.
    """
    lines = message.splitlines()
    stack: list[tuple[int, str]] = []
    # (indent, path) -> expected types, given value, other reasons
    found: dict[tuple[int, str], dict] = {}
    for i, line in enumerate(lines):
        key = _KEY.match(line)
        if key:
            indent = len(key.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key.group(2)))
            continue
        if not line.strip() or _NOISE.match(line) or _GIVEN.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        path = ".".join(k for ind, k in stack if ind < indent)
        if not path:
            continue
        entry = found.setdefault((indent, path), {"types": [], "given": None, "other": []})
        exp = _EXPECTED.match(line)
        if exp:
            if "NoneType" not in exp.group(2):
                entry["types"].append(_describe_type(exp.group(2)))
            given = exp.group(3)
            if given is None:
                later = (_GIVEN.match(ln) for ln in lines[i + 1 :])
                given = next((g.group(1) for g in later if g), None)
            entry["given"] = entry["given"] or given
        else:
            entry["other"].append(line.strip().lstrip("- "))
    useful = {k: v for k, v in found.items() if v["types"] or v["other"]}
    if useful:
        (_, path), entry = max(useful.items(), key=lambda kv: kv[0][0])
        if entry["types"]:
            got = f"; got {entry['given']!r}" if entry["given"] is not None else ""
            return f"{path}: expected {' or '.join(entry['types'])}{got}"
        return f"{path}: {'; '.join(entry['other'])}"
    kept = [ln.strip() for ln in lines if ln.strip()][:3]
    return " ".join(kept)


# ---- values Lightning or torch would reject later ---------------------------------------
# (option, smallest value, what it means); None is always allowed where Lightning allows it.
_TRAINER_MINIMA = {
    "max_steps": (-1, "-1 (no limit) or a number of steps"),
    "min_steps": (0, "a number of steps"),
    "max_epochs": (-1, "-1 (no limit) or a number of epochs"),
    "min_epochs": (0, "a number of epochs"),
    "log_every_n_steps": (1, "a number of steps"),
    "check_val_every_n_epoch": (1, "a number of epochs"),
    "accumulate_grad_batches": (1, "a number of batches"),
    "num_sanity_val_steps": (-1, "-1 (all) or a number of batches"),
    "gradient_clip_val": (0, "a gradient norm or value"),
}
_FRACTION_OR_COUNT = (
    "val_check_interval",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
)


def check_trainer_values(trainer: Any) -> list[str]:
    """Problems with the trainer's numeric settings (one line each), and warnings.

    Returns the warnings; raises ``UsageError`` naming every problem."""
    get = trainer.get if hasattr(trainer, "get") else (lambda k, d=None: d)
    problems, warnings = [], []
    for key, (low, meaning) in _TRAINER_MINIMA.items():
        value = get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < low:
            problems.append(f"--trainer.{key} {value}: must be at least {low} ({meaning})")
    for key in _FRACTION_OR_COUNT:
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value < 0 or (key == "val_check_interval" and value == 0):
            problems.append(
                f"--trainer.{key} {value}: must be a fraction of an epoch in (0, 1] or a "
                "number of batches"
            )
        elif isinstance(value, float) and value > 1 and not value.is_integer():
            problems.append(
                f"--trainer.{key} {value}: a float is a fraction of an epoch (at most 1.0); "
                "write a whole number of batches as an integer"
            )
    if problems:
        raise UsageError("invalid trainer settings: " + "; ".join(problems))
    if get("max_steps") == 0 or get("max_epochs") == 0:
        which = "max_steps" if get("max_steps") == 0 else "max_epochs"
        warnings.append(f"--trainer.{which} 0: nothing will be trained")
    return warnings


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_model_size(max_len: Any, d_model: Any, *, source: str) -> None:
    """A position table of ``max_len x d_model`` floats (and its gradient and two Adam
    moments) that cannot fit in this machine's memory is refused up front."""
    if not (isinstance(max_len, int) and isinstance(d_model, int)):
        return
    if max_len < 1:
        raise UsageError(f"{source} {max_len}: must be at least 1")
    need = 4 * max_len * d_model * 4
    have = physical_memory()
    if have is not None and need > have:
        raise UsageError(
            f"{source} {max_len}: the position table (max_len x d_model = {max_len} x {d_model} "
            f"floats, with its gradient and Adam moments) needs {need / 2**30:,.0f} GiB, more "
            f"than this machine's {have / 2**30:,.0f} GiB: lower {source}"
        )


# ---- paths -------------------------------------------------------------------------------
def check_experiment(name: str) -> None:
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UsageError(
            f"--experiment {name!r}: an experiment is one folder name under --runs_dir (no "
            "'/', '\\' or '..'); to group runs, point --runs_dir at a subfolder, e.g. "
            "--runs_dir runs/lra_listops --experiment macformer"
        )


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_folder(path: str | os.PathLike, option: str, *, write: bool) -> None:
    """``path`` is a folder (or can be made one) that this process can read, and write when
    ``write``; else one line naming the option to change."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{option} {path}: is a file, not a folder: name a folder")
        if not os.access(p, os.R_OK | os.X_OK):
            raise UsageError(f"{option} {path}: the folder is not readable: change {option}")
        if write and not os.access(p, os.W_OK):
            raise UsageError(f"{option} {path}: the folder is not writable: change {option}")
        return
    base = nearest_existing(p)
    if not base.is_dir():
        raise UsageError(f"{option} {path}: {base} is a file, not a folder: change {option}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(
            f"{option} {path}: does not exist and cannot be created ({base} is not "
            f"writable): change {option}"
        )


# ---- launch and environment ------------------------------------------------------------
def cluster_environment() -> str | None:
    """The launcher that started this process for a multi-node run, by the variables it
    sets (Lightning detects the same ones), or None for a process started by hand."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") or ("GROUP_RANK" in env and "WORLD_SIZE" in env):
        return "torchrun"
    # Lightning ignores SLURM for an interactive allocation (job name bash/interactive).
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"
    if {"LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK"} <= env.keys():
        return "LSF"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "MPI"
    # A multi-node launch by hand (Lightning's own environment): each node sets these.
    if "NODE_RANK" in env and "MASTER_ADDR" in env:
        return "NODE_RANK/MASTER_ADDR"
    return None


def check_launch(trainer: Any) -> None:
    """More than one node needs a launcher that starts the other nodes; without one, rank 0
    waits for them forever ("MEMBER: 1/2"), its run folder made."""
    get = trainer.get if hasattr(trainer, "get") else (lambda k, d=None: d)
    nodes = get("num_nodes")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes <= 1:
        if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes < 1:
            raise UsageError(f"--trainer.num_nodes {nodes}: must be at least 1")
        return
    plugins = get("plugins") or []
    plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    if any("Environment" in str(getattr(p, "class_path", p)) for p in plugins):
        return  # the user named a cluster environment: it knows where the nodes are
    if cluster_environment() is None:
        raise UsageError(
            f"--trainer.num_nodes {nodes}: no cluster launcher found (SLURM, torchrun, LSF, "
            "MPI, or NODE_RANK and MASTER_ADDR set by hand), so this process would wait for the "
            f"other {nodes - 1} node(s) forever: start it on every node with srun or "
            f"'torchrun --nnodes {nodes} ...', or on one machine use --trainer.num_nodes 1 "
            "--trainer.devices N"
        )


def check_schedule(trainer: Any, *, linear_decay: bool) -> None:
    """A fit must end: Lightning quietly picks 1000 epochs when neither ``max_steps`` nor
    ``max_epochs`` is set, and ``max_epochs -1`` never ends; the tasks' linear-decay schedule
    also needs the number of steps up front (``estimated_stepping_batches``)."""
    get = trainer.get if hasattr(trainer, "get") else (lambda k, d=None: d)
    steps, epochs, max_time = get("max_steps"), get("max_epochs"), get("max_time")
    if isinstance(steps, int) and steps >= 0:
        return
    fix = "set --trainer.max_steps N or --trainer.max_epochs N"
    if epochs is None:
        raise UsageError(
            "neither --trainer.max_steps nor --trainer.max_epochs is set, so nothing says when "
            f"training ends (Lightning would pick 1000 epochs): {fix}"
        )
    if isinstance(epochs, int) and epochs < 0:
        if linear_decay:
            raise UsageError(
                f"--trainer.max_epochs {epochs} with no --trainer.max_steps: training never ends "
                f"and the linear-decay learning-rate schedule needs its length: {fix}"
            )
        if max_time is None:
            raise UsageError(
                f"--trainer.max_epochs {epochs} with no --trainer.max_steps or "
                f"--trainer.max_time: training never ends: {fix}"
            )


# numpy's legacy seeding and Lightning's seed_everything take 0 .. 2**32 - 1.
SEED_MAX = 2**32 - 1


def check_seeds(cfg: Any, prefix: str = "") -> None:
    """``seed_everything`` and every option named ``seed`` or ``*_seed`` (data, redraws,
    generators): an integer in 0 .. 2**32 - 1, refused here rather than deep inside numpy
    or Lightning once data is generated or training has begun."""
    items = cfg.items() if hasattr(cfg, "items") else []
    for key, value in items:  # a jsonargparse Namespace yields dotted leaf keys
        name, leaf = f"{prefix}{key}", str(key).rsplit(".", 1)[-1]
        if leaf in ("seed_everything", "seed") or leaf.endswith("_seed"):
            if isinstance(value, int) and not isinstance(value, bool):
                if not 0 <= value <= SEED_MAX:
                    raise UsageError(
                        f"--{_option(name)} {value}: a seed must be an integer from 0 to "
                        f"{SEED_MAX} (2**32 - 1): choose one in that range"
                    )
        elif hasattr(value, "items"):
            check_seeds(value, f"{name}.")


def _option(name: str) -> str:
    """A config key as the command line spells it (``data.init_args.seed`` -> ``data.seed``)."""
    return name.replace(".init_args.", ".")


def disk_full(err: BaseException | None, *, started: bool = True) -> str | None:
    """One line for a write that failed for want of space anywhere in ``err``'s chain
    (Lightning's config.yaml and hparams.yaml, torch's checkpoints, our metrics.csv), or
    None. A full disk is the user's to fix, not a bug to show a traceback for. ``started``:
    a run folder was kept (a loop had begun), so the fix ends with resuming it."""
    import errno as errno_codes

    codes = {errno_codes.ENOSPC, errno_codes.EFBIG, getattr(errno_codes, "EDQUOT", 122)}
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in codes:
            if type(err).__str__ is not OSError.__str__:
                return str(err)  # already one line naming the file and the fix
            where = err.filename or _file_being_written(err) or "a file of the run"
            then = ", then resume with --ckpt_path last" if started else " and run it again"
            return (
                f"could not write {where} ({err.strerror}): the disk (or your quota, or the "
                f"file-size limit) is full; free disk space or point --runs_dir at another "
                f"disk{then}"
            )
        err = err.__cause__ or err.__context__
    return None


def check_feature_memory(
    spec: Any,
    *,
    where: str,
    batch_size: Any,
    max_len: Any,
    num_heads: int,
    head_dim: int,
    num_layers: Any,
    precision: Any = None,
) -> None:
    """A random-feature backend whose feature tensors cannot fit in memory is refused up
    front, with the estimate: building it (a trial build checks every spec) or its first
    batch would otherwise be killed by the kernel, or swap for minutes. The estimate is a
    lower bound: the query and key features of one batch at the longest length, in every
    layer whose activations the backward pass keeps (one with ``recompute: true``), and the
    drawn projections. ``spec``: the CLI's parsed value (``attention.ParsedSpec``), or a
    mapping, parsed here."""
    from macformer_lit.attention.spec import ParsedSpec, parse_spec

    if isinstance(spec, dict):
        try:
            spec = parse_spec(spec)
        except ValueError:
            return  # a spec that does not parse: the attention check names what is wrong
    if not isinstance(spec, ParsedSpec):
        return
    spec = spec.as_dict()  # as written: an option left at its default is not estimated
    features = spec.get("num_features")
    ints = (features, batch_size, max_len)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
        return
    layers = num_layers if isinstance(num_layers, int) and num_layers > 0 else 1
    kept = 1 if spec.get("recompute") else layers
    size = 2 if "16" in str(precision or "") else 4
    need = 2 * batch_size * num_heads * max_len * features * size * kept
    need += features * head_dim * 4 * layers
    have = physical_memory()
    if have is None or need <= have:
        return
    raise UsageError(
        f"{where}: num_features {features:,} cannot fit in memory: the query and key features "
        f"of one batch ({batch_size} x {num_heads} heads x {max_len} positions x "
        f"{features:,} features, {size} bytes each, in {kept} layer(s) kept for the backward "
        f"pass) need at least {need / 2**30:,.0f} GiB, more than this machine's "
        f"{have / 2**30:,.0f} GiB: lower num_features, or --data.batch_size or --data.max_len"
        + ("" if spec.get("recompute") else " (recompute: true keeps one layer's)")
    )


def _file_being_written(err: BaseException) -> str | None:
    """The path a failed write was writing, from its frames' locals (innermost first): an
    ``OSError`` from ``write`` carries no file name, and fsspec's and torch's writers hold it
    as ``path``, ``filepath`` or ``config_path``."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for name in ("path", "filepath", "file_path", "config_path", "filename", "fname"):
            value = frame.f_locals.get(name)
            if isinstance(value, (str, os.PathLike)) and str(value):
                return str(value)
    return None


def check_task_given(argv: list[str], task_configs: list[str]) -> None:
    """``fit``/``validate``/``test``/``predict`` need a model class and a data class, which
    the task configs (``lra_listops.yaml`` ...) name; the other shipped configs are overlays
    (``attention/``, ``schedule/``, ``trainer/``) whose options mean nothing alone. Without a
    task, jsonargparse says "Option 'attention.name' is not accepted" or "the following
    arguments are required: fit.data, fit.model"; here it is what to add. ``argv``: the
    command line with config names resolved to paths."""
    if not argv or argv[0] not in ("fit", "validate", "test", "predict"):
        return  # a config before the subcommand holds subcommand keys: jsonargparse checks
    if any(a in ("-h", "--help") or a.startswith("--print_config") for a in argv):
        return
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    given = {"model": False, "data": False}
    for key in given:
        if any(a == f"--{key}" or a.startswith((f"--{key}=", f"--{key}.class_path")) for a in argv):
            given[key] = True
    loaded = []
    for path in configs:
        try:
            data = yamlio.load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            return  # check_config_file has said what is wrong with it
        data = data if isinstance(data, dict) else {}
        names = [k for k in given if _names_class(data.get(k))]
        for key in names:
            given[key] = True
        loaded.append((path, data, bool(names)))
    _check_overlay_order(loaded)
    missing = [key for key, found in given.items() if not found]
    if not missing:
        return
    example = "lra_listops.yaml" if "lra_listops.yaml" in task_configs else task_configs[0]
    tasks = f"task configs: {', '.join(task_configs)}"
    what = " and ".join(f"no {key} class" for key in missing)
    if configs:
        names = " ".join(f"--config {_shipped_name(p)}" for p in configs)
        overlay = "this config is an overlay" if len(configs) == 1 else "these are overlays"
        raise UsageError(
            f"{names}: {what} given: {overlay} "
            f"for a task config, which names the model and data; put one first, e.g. "
            f"--config {example} {names} ({tasks})"
        )
    raise UsageError(
        f"{argv[0]} needs a model and data: give a task config, e.g. --config {example} "
        f"({tasks}), or --model and --data"
    )


def _names_class(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and "class_path" in value)


def _check_overlay_order(loaded: list[tuple[str, dict, bool]]) -> None:
    """Configs compose in order, the later winning: an overlay (``attention/…``) given before
    a task config that sets the same options is silently undone by it (the task's own
    attention trains). Refused, naming the options and the order that works."""
    for i, (overlay, data, is_task) in enumerate(loaded):
        if is_task:
            continue
        ours = set(_leaf_keys(data))
        for task, later, later_is_task in loaded[i + 1 :]:
            if not later_is_task:
                continue
            undone = sorted(ours & set(_leaf_keys(later)))
            if undone:
                shown = ", ".join(undone[:3]) + (" …" if len(undone) > 3 else "")
                raise UsageError(
                    f"--config {_shipped_name(overlay)} comes before the task config "
                    f"--config {_shipped_name(task)}, which sets {shown} again and would undo "
                    f"it (later configs win): give the task config first, --config "
                    f"{_shipped_name(task)} --config {_shipped_name(overlay)}"
                )


def _leaf_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a config's options, ``init_args`` dropped (``model.attention.name``):
    a task config and an overlay may write the same option with or without it."""
    if not isinstance(data, dict) or not data:
        return [prefix] if prefix else []
    keys = []
    for k, v in data.items():
        if k in ("init_args", "class_path") and prefix:
            keys += _leaf_keys(v, prefix) if k == "init_args" else []
            continue
        keys += _leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))
    return keys


def _shipped_name(path: str) -> str:
    """A shipped config as the user named it (``attention/rmfa_exp.yaml``), others as given."""
    parts = Path(path).parts
    if "configs" in parts:
        return "/".join(parts[len(parts) - parts[::-1].index("configs") :])
    return path


def _assigned_attributes(cls: type) -> set[str] | None:
    """Every ``self.<name> = ...`` in the methods of ``cls`` and its bases, read from their
    source; None when a class has no source to read (then nothing is judged)."""
    import ast
    import inspect
    import textwrap

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return None
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        names.add(t.attr)
    return names


def check_task_data(model_cls: type, data_cls: type, linked: tuple[str, ...]) -> None:
    """The model's sizes that only its data can give (``vocab_size``, ``num_classes``,
    ``bos_id`` ...: the CLI links them) must exist on the data: a translation model on
    classification data has no ``bos_id``, a classifier on translation data no
    ``num_classes``, and the model would fail inside its constructor ("'<=' not supported
    between instances of 'int' and 'NoneType'"), after the data had built its vocabulary.
    Judged from the classes (a class attribute or property, or an assignment in a method),
    before anything is built."""
    import inspect

    constructors = getattr(model_cls, "_constructors", None)
    inits = constructors() if callable(constructors) else [model_cls.__init__]
    required: list[str] = []
    for init in inits:
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            continue
        required += [
            n for n in linked if n in params and params[n].default is inspect.Parameter.empty
        ]
    assigned = _assigned_attributes(data_cls)
    if not required or assigned is None:
        return

    def has(name: str) -> bool:
        return inspect.getattr_static(data_cls, name, None) is not None or name in assigned

    missing = [n for n in dict.fromkeys(required) if not has(n)]
    if not missing:
        return

    def kind(needs) -> str:
        if needs("bos_id"):
            return "sequence-to-sequence"
        return "classification" if needs("num_classes") else ""

    model_kind, data_kind = kind(lambda n: n in required), kind(has)
    model_name, data_name = model_cls.__name__, data_cls.__name__
    mismatch = ""
    if model_kind and data_kind and model_kind != data_kind:
        mismatch = f" ({model_kind} model, {data_kind} data)"
    raise UsageError(
        f"model {model_name} does not fit data {data_name}{mismatch}: the model needs "
        f"{', '.join(missing)} from its data, and {data_name} has none: pair a translation "
        "model with translation data (translation_synthetic.yaml, multi30k.yaml) and a "
        "classifier with classification data (lra_*.yaml, listops_short_cpu.yaml)"
    )


# ---- the parsed command line (cli.MacformerCLI) --------------------------------------------
def import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(import_module(module), name)


def is_task(model) -> bool:
    """Whether the model config names one of our tasks (``LitTask``: linear-decay schedule)."""
    class_path = model.get("class_path") if model is not None and "class_path" in model else None
    if not isinstance(class_path, str):
        return False
    try:
        cls = import_class(class_path)
    except Exception:  # not importable here: jsonargparse reports it
        return False
    return isinstance(cls, type) and issubclass(cls, LitTask)


def attention_arguments(class_path: str | None) -> list[str]:
    """The model's options typed ``AttentionSpec`` (its attention specs): a task's own and
    its model classes' (``LitTask.option_hints``), or any other class's constructor's."""
    if not class_path:
        return []
    try:
        cls = import_class(class_path)
        is_lit_task = isinstance(cls, type) and issubclass(cls, LitTask)
        hints = cls.option_hints() if is_lit_task else typing.get_type_hints(cls.__init__)
    except Exception:  # not importable here: jsonargparse reports it
        return []
    return spec_arguments(hints)


def parse_attention_arguments(keys: list[str], init) -> dict[str, Any]:
    """Each attention argument ``keys`` of the model's ``init`` parsed once, into the value
    the checks and the trial build take (``attention.ParsedSpec``), or the ``ValueError``
    that ``check_attention`` raises once the checks before it have passed; anything else
    is kept as given, for ``check_attention_spec`` to refuse. A bare name becomes its
    mapping in ``init``: config.yaml records the mapping."""
    specs: dict[str, Any] = {}
    for key in keys:
        spec = init.get(key)
        spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
        if not isinstance(spec, (dict, str)):
            specs[key] = spec
            continue
        try:
            specs[key] = parse_spec(spec)
        except ValueError as err:
            specs[key] = err
            continue
        if isinstance(spec, str):
            init[key] = specs[key].as_dict()
    return specs


# A model's role-specific attention arguments; ``attention`` fills every role it lacks.
ROLE_ARGUMENTS = {
    "encoder_attention": "encoder",
    "decoder_attention": "decoder",
    "cross_attention": "cross",
}


def attention_roles(key: str, keys: list[str], init) -> tuple[str, ...]:
    """Where the model builds the attention argument ``key``: its own role, or (for a
    shared ``attention``) the encoder's and each role whose own argument is not set."""
    if key in ROLE_ARGUMENTS:
        return (ROLE_ARGUMENTS[key],)
    roles = [r for k, r in ROLE_ARGUMENTS.items() if k in keys and not init.get(k)]
    return tuple(roles) if roles else ("encoder",)


def check_command(cfg, *, fit: bool, rank_zero: bool, linked: tuple[str, ...]) -> dict[str, Any]:
    """Names, paths, trainer values and sizes, checked before anything is built; returns
    the model's attention specs parsed (``parse_attention_arguments``). ``rank_zero``: this
    process prints the warnings; ``linked``: the sizes the CLI links from data to model."""
    if cfg.get("experiment") is not None:
        check_experiment(cfg.get("experiment"))
    check_folder(cfg.get("runs_dir") or "runs", "--runs_dir", write=True)
    data = cfg.get("data")
    data_init = data.get("init_args") if data is not None and "init_args" in data else None
    if data_init is not None and isinstance(data_init.get("data_dir"), str):
        check_folder(data_init.get("data_dir"), "--data.data_dir", write=False)
    for warning in check_trainer_values(cfg.get("trainer") or {}):
        if rank_zero:
            print(f"macformer_lit: warning: {warning}", file=sys.stderr, flush=True)
    model = cfg.get("model")
    # Launch and environment (here and loggers.py): each one line, before any build.
    check_launch(cfg.get("trainer") or {})
    check_seeds(cfg)
    if fit:
        check_schedule(cfg.get("trainer") or {}, linear_decay=is_task(model))
    logger = (cfg.get("trainer") or {}).get("logger")
    if (logger is None or logger is True) and cfg.get("wandb_mode") != "disabled":
        check_wandb_mode(cfg.get("wandb_mode"))
    try:  # a model and data of different tasks (check_task_data)
        classes = (import_class(model.get("class_path")), import_class(data.get("class_path")))
    except Exception:  # not importable here: jsonargparse reports it
        classes = None
    if classes is not None:
        check_task_data(*classes, linked)
    init = model.get("init_args") if model is not None and "init_args" in model else None
    specs: dict[str, Any] = {}
    if init is None:
        return specs
    keys = attention_arguments(model.get("class_path"))
    specs = parse_attention_arguments(keys, init)
    data_max = data_init.get("max_len") if data_init is not None else None
    max_len = data_max if data_max is not None else init.get("max_len")
    source = "--data.max_len" if data_max is not None else "--model.init_args.max_len"
    check_model_size(max_len, init.get("d_model"), source=source)
    d_model, heads = init.get("d_model"), init.get("num_heads")
    for key in keys:
        spec = specs.get(key)
        if not (isinstance(d_model, int) and isinstance(heads, int) and heads > 0):
            break
        # Before the trial build of check_attention, which allocates the draw.
        check_feature_memory(
            spec if isinstance(spec, ParsedSpec) else None,
            where=f"model.init_args.{key}",
            batch_size=data_init.get("batch_size") if data_init is not None else None,
            max_len=max_len,
            num_heads=heads,
            head_dim=max(d_model // heads, 1),
            num_layers=init.get("num_layers", init.get("num_encoder_layers")),
            precision=(cfg.get("trainer") or {}).get("precision"),
        )
    return specs


def check_attention(cfg, specs: dict[str, Any]) -> None:
    """Every attention spec of the model (its arguments typed ``AttentionSpec``, parsed
    by ``check_command`` into ``specs``), checked by a trial build (attention/spec.py)."""
    model = cfg.get("model")
    init = model.get("init_args") if model is not None and "init_args" in model else None
    if init is None or "d_model" not in init or "num_heads" not in init:
        return  # not one of our models: its own constructor checks
    d_model, num_heads = init.get("d_model"), init.get("num_heads")
    if not (isinstance(d_model, int) and isinstance(num_heads, int)) or num_heads < 1:
        return
    if d_model % num_heads:
        raise ValueError(
            f"model.init_args.d_model={d_model} is not divisible by num_heads={num_heads}"
        )
    keys = attention_arguments(model.get("class_path"))
    layers = init.get("num_layers", init.get("num_encoder_layers"))
    for key in keys:
        spec = specs.get(key)
        if isinstance(spec, ValueError):
            raise ValueError(f"model.init_args.{key}: {spec}")
        check_attention_spec(
            spec,
            head_dim=d_model // num_heads,
            num_heads=num_heads,
            where=f"model.init_args.{key}",
            roles=attention_roles(key, keys, init),
            num_layers=layers if isinstance(layers, int) else None,
        )
