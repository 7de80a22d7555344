"""What ran, recorded: ``provenance.yaml`` beside ``config.yaml`` in every run folder.

A YAML list with one dated entry per start of ``fit``, ``validate``, ``test`` or ``predict``
in the folder, written by rank 0 when the first loop starts (a run that fails before that
leaves no entry). A resume appends its own entry, with the settings it changed
(``changes``), and never rewrites the first ``config.yaml``; ``effective_config`` applies
those changes for readers (``report``). Each entry holds the code (commit, uncommitted
changes, a digest of the package's Python files, versions), the machine (device names, CPU
model, intra-op threads), the precision asked and the one that ran, the world size and the
command line (docs/architecture.md §6). Records written after the fact for committed
results say so (``recovered``) and mark what their sources do not give as ``unknown``.

``code_identity`` is what ``report`` compares before it averages runs.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from macformer_lit import moved_keys, yamlio

RECORD = "provenance.yaml"
UNKNOWN = "unknown"
PACKAGE_DIR = Path(__file__).resolve().parent
# Fields two runs must share to be averaged (report): the code they ran, and the two
# settings config.yaml cannot tell, the precision that ran and the number of processes.
CODE_FIELDS = ("commit", "dirty", "package", "torch", "lightning", "cuda")
SETTING_FIELDS = ("precision", "world_size")
# Recorded on every checkpoint a CLI run saves: the config it trained with, so a resume is
# compared with the checkpoint itself, wherever it was moved (checkpoints.check_fits).
CHECKPOINT_KEY = "macformer_lit_run"


class RecordError(ValueError):
    """A ``provenance.yaml`` that cannot be read."""


# ---- the code ------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR.parent), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


# The package's code: Python, and the C++ its native kernels build from (attention/csrc/;
# commits before those files existed hash as they did).
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def package_digest() -> str:
    """sha256 of the package's source files (paths and bytes, SOURCE_SUFFIXES): two commits
    that did not change the package's code share it, and so do two runs from one uncommitted
    tree."""
    files = {
        p.relative_to(PACKAGE_DIR).as_posix(): p.read_bytes
        for p in PACKAGE_DIR.rglob("*")
        if p.suffix in SOURCE_SUFFIXES and p.is_file()
    }
    return _digest((name, files[name]) for name in sorted(files))


def _digest(files) -> str:
    """sha256 over ``(relative path, read)`` pairs, in the order given: the one recipe of
    ``package_digest`` and ``digest_at``."""
    digest = hashlib.sha256()
    for name, read in files:
        digest.update(name.encode() + b"\0")
        digest.update(read() + b"\0")
    return "sha256:" + digest.hexdigest()[:16]


def digest_at(commit: str) -> str:
    """``package_digest`` of the package as committed at ``commit``, read from git (for
    records written after the fact); ``unknown`` where git or the commit is missing."""
    listing = _git("ls-tree", "-r", "-z", "--name-only", commit, "--", "macformer_lit")
    if listing is None:
        return UNKNOWN
    names = sorted(
        Path(n).relative_to("macformer_lit").as_posix()
        for n in listing.split("\0")
        if n.endswith(SOURCE_SUFFIXES)
    )

    def show(name: str):
        def read() -> bytes:
            blob = subprocess.run(
                ["git", "-C", str(PACKAGE_DIR.parent), "show", f"{commit}:macformer_lit/{name}"],
                capture_output=True,
                timeout=20,
                check=True,
            )
            return blob.stdout

        return read

    try:
        return _digest((name, show(name)) for name in names)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def code() -> dict[str, Any]:
    """The commit of the package's own checkout (``unknown`` for an installed wheel) and
    whether the package's files differ from it (tracked changes or untracked files under
    ``macformer_lit/``; edits elsewhere in the tree do not change what runs)."""
    from macformer_lit import __version__

    top = _git("rev-parse", "--show-toplevel")
    ours = top is not None and Path(top.strip()).resolve() == PACKAGE_DIR.parent
    commit = (_git("rev-parse", "HEAD") or "").strip() if ours else ""
    status = _git("status", "--porcelain", "--untracked-files=all", "--", "macformer_lit")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {
        "commit": commit or UNKNOWN,
        "dirty": UNKNOWN if not commit or status is None else bool(changed),
        **({"dirty_files": changed[:20]} if commit and changed else {}),
        "digest": package_digest(),
        "package": __version__,
    }


def versions() -> dict[str, Any]:
    import lightning
    import torch

    return {
        "python": platform.python_version(),
        # str(): torch's version is a str subclass that YAML would not write.
        "torch": str(torch.__version__),
        "lightning": str(lightning.__version__),
        # None: a CPU build of torch.
        "cuda": str(torch.version.cuda or "none"),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


# The CPU features the kernels choose by (attention/maclaurin.py, choose_kernels).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def attention_kernels(module) -> list[str]:
    """The kernels each distinct attention of ``module`` runs (``kernel_choice``: the options
    on, or what ``auto_kernels`` chose on this machine)."""
    if module is None:
        return []
    return sorted({m.kernel_choice for m in module.modules() if hasattr(m, "kernel_choice")})


def machine(trainer) -> dict[str, Any]:
    import torch

    accelerator = type(trainer.accelerator).__name__.replace("Accelerator", "").lower()
    devices = ["cpu"] * len(trainer.device_ids or [0])
    if accelerator == "cuda":
        devices = [torch.cuda.get_device_name(i) for i in trainer.device_ids]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "accelerator": accelerator,
        "devices": devices,
        "num_nodes": trainer.num_nodes,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_cores": cores,
        "threads": torch.get_num_threads(),
    }


def entry(
    trainer,
    *,
    subcommand: str,
    argv: list[str],
    asked_precision: Any,
    checkpoint: Mapping[str, Any] | None = None,
    changes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One dated record of this process's run, as the Trainer built it: ``checkpoint`` is
    the one it resumed (fit) or scored, ``changes`` the settings a resume changed."""
    record: dict[str, Any] = {
        "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "subcommand": subcommand,
        "command": shlex.join(["python", "-m", "macformer_lit", *argv]),
        "python_executable": sys.executable,
        "cwd": os.getcwd(),
        "code": code(),
        "versions": versions(),
        "machine": machine(trainer),
        # Lightning may run another precision than asked (16-mixed on a CPU runs bf16).
        "precision": {"asked": asked_precision, "used": str(trainer.precision)},
        "world_size": trainer.world_size,
    }
    kernels = attention_kernels(trainer.lightning_module)
    if kernels:
        record["attention_kernels"] = kernels
    if checkpoint:
        record["checkpoint"] = dict(checkpoint)
    if changes:
        record["changes"] = changes
    return record


# ---- reading and writing -------------------------------------------------------------------
def append(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Add ``record`` at the end of the folder's list; earlier entries are never rewritten."""
    text = yaml.safe_dump([dict(record)], sort_keys=False, allow_unicode=True, width=100)
    path = Path(run_dir) / RECORD
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The folder's entries, oldest first; [] without a record."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return []
    try:
        loaded = yamlio.load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecordError(f"{RECORD} is not valid YAML ({first})") from None
    if loaded is None:
        return []
    if not isinstance(loaded, list) or not all(isinstance(e, dict) for e in loaded):
        raise RecordError(f"{RECORD} is not a list of entries")
    return loaded


def set_key(config: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def effective_config(config: dict, entries: list[dict[str, Any]]) -> dict:
    """``config.yaml`` with the changes later resumes recorded, oldest first (a resume never
    rewrites ``config.yaml``): what the run's last part trained with, its keys where they
    are now (``moved_keys``: a run recorded before a key moved compares as it should)."""
    config, _ = moved_keys.migrate_config(config)
    for record in entries:
        for change in record.get("changes") or []:
            if isinstance(change, dict) and isinstance(change.get("key"), str):
                for key, value in moved_keys.migrate_change(change["key"], change.get("new")):
                    set_key(config, key, value)
    return config


def _value(record: Mapping[str, Any], field: str) -> Any:
    if field in ("commit", "dirty", "digest", "package"):
        value = (record.get("code") or {}).get(field, UNKNOWN)
    elif field in ("torch", "lightning", "cuda", "python"):
        value = (record.get("versions") or {}).get(field, UNKNOWN)
    elif field == "precision":
        value = (record.get("precision") or {}).get("used", UNKNOWN)
    elif field == "world_size":
        value = record.get("world_size", UNKNOWN)
    else:
        value = (record.get("machine") or {}).get(field, UNKNOWN)
    if field == "commit" and isinstance(value, str) and value != UNKNOWN:
        value = value[:7]
    if isinstance(value, list):
        value = ", ".join(dict.fromkeys(map(str, value))) or UNKNOWN
    return UNKNOWN if value is None else value


def summary(entries: list[dict[str, Any]]) -> dict[str, str]:
    """Per field, the run's value as text: from its ``fit`` entries when it has any (the test
    after fit is part of the fit), the values of every part joined with ``+`` where a resume
    ran other code; ``unknown`` without a record."""
    fits = [e for e in entries if e.get("subcommand") == "fit"] or entries
    fields = (*CODE_FIELDS, "digest", *SETTING_FIELDS, "devices", "cpu", "threads")
    out = {}
    for field in fields:
        values = [str(_value(e, field)) for e in fits] or [UNKNOWN]
        out[field] = "+".join(dict.fromkeys(values))
    return out


def code_identity(summary: Mapping[str, str]) -> dict[str, str]:
    """What two runs must share to be averaged (docs/architecture.md §6): the package's code,
    by the digest of its Python files (so a commit that did not change the package, or an
    uncommitted tree, compares by what ran), the versions, the precision that ran and the
    world size. ``unknown`` is a value of its own: it matches only ``unknown``."""
    fields = [f for f in (*CODE_FIELDS, *SETTING_FIELDS) if f not in ("commit", "dirty")]
    return {"code": summary.get("digest", UNKNOWN), **{f: summary.get(f, UNKNOWN) for f in fields}}
