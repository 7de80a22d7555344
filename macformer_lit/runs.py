"""Run folders: ``<runs_dir>/<experiment>/version_<n>/``, named and found in one place.

The CLI claims a new folder (``RunFolder``), resumes the newest one holding a checkpoint
(``checkpoints.newest_checkpoint`` walks ``versions``), the sweep finds each grid point's
newest run (``newest_version``), and the report reads any tree of them.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from macformer_lit.preflight import UsageError, nearest_existing

VERSION = re.compile(r"version_(\d+)")


def version_folder(exp_dir: Path, n: int) -> Path:
    """The folder of version ``n`` of an experiment (the one place the name is written)."""
    return Path(exp_dir) / f"version_{n}"


def versions(exp_dir: Path) -> list[tuple[int, Path]]:
    """The ``version_<n>`` folders of an experiment, newest (largest n) first."""
    found = []
    for p in Path(exp_dir).glob("version_*"):
        m = VERSION.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def next_version(exp_dir: Path) -> int:
    """The number after the largest ``version_<n>`` taken (files of that name included)."""
    names = (p.name for p in Path(exp_dir).glob("version_*"))
    taken = [int(m.group(1)) for name in names if (m := VERSION.fullmatch(name))]
    return max(taken, default=-1) + 1


def launch_rank() -> int:
    """This process's global rank as its launcher set it, before any process group exists:
    torchrun's ``RANK``, SLURM's ``SLURM_PROCID``; 0 for a process started by hand (ranks
    that Lightning launches inherit rank 0's folder instead, through the environment)."""
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def newest_version(exp_dir: Path) -> Path | None:
    found = versions(exp_dir)
    return found[0][1] if found else None


class RunFolder:
    """The run's ``exp_dir/version_<n>``, claimed atomically, removable while unused.

    ``claim`` creates ``version_<next_version>``, or the next free one: ``mkdir`` fails when
    another process created the same folder first, so two runs started at once never share
    one. Until ``keep`` is called (the run has started), ``abandon`` removes it with
    everything in it and the parent folders the claim created, so a run that fails to
    start leaves nothing behind.
    """

    def __init__(self, exp_dir: Path) -> None:
        self.exp_dir = exp_dir
        self.path: Path | None = None
        self.kept = False
        self._existing = nearest_existing(exp_dir)

    def claim(self) -> Path:
        n = next_version(self.exp_dir)
        while True:
            folder = version_folder(self.exp_dir, n)
            try:
                self.exp_dir.mkdir(parents=True, exist_ok=True)
                folder.mkdir()
            except FileExistsError:
                n += 1
                continue
            except OSError as err:
                raise UsageError(
                    f"cannot create the run folder {folder} ({err.strerror}): change --runs_dir"
                ) from None
            self.path = folder
            return folder

    def keep(self) -> None:
        self.kept = True

    def abandon(self) -> None:
        if self.kept or self.path is None or not self.path.is_dir():
            return
        shutil.rmtree(self.path, ignore_errors=True)
        parent = self.path.parent.absolute()
        while parent != self._existing and parent.is_relative_to(self._existing):
            try:
                parent.rmdir()  # only if empty
            except OSError:
                break
            parent = parent.parent
        self.path = None
