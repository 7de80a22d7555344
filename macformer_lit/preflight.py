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
  (``check_experiment``).

Then ``runs.RunFolder`` takes the run's folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from macformer_lit import yamlio


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


def install_parser_loaders() -> None:
    """jsonargparse loads every config and inline YAML value with a loader that refuses a
    key given twice (``UsageError`` naming the file, or the value, and the line): its own
    loaders keep the last duplicate, or, for an inline mapping, take the text as a string."""
    from jsonargparse import get_loader, set_loader

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
        try:
            yamlio.check_unique_keys(value)
        except yamlio.DuplicateKeyError as err:
            one_line = " ".join(value.split())
            what = f"config {path}" if path else f"YAML value {one_line[:60]!r}"
            # SystemExit: jsonargparse treats a loader's errors as "not YAML, a string".
            raise UsageError(yamlio.describe(err, what)) from None
        except yaml.YAMLError:
            pass  # not YAML: jsonargparse decides what the text is, as it always did
        return base(value)

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
