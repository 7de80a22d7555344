"""Run folders: ``<runs_dir>/<experiment>/version_<n>/``, named and found in one place.

The CLI claims a new folder (``RunFolder``) and keeps this process's folders in one
``RunFolders``, resumes the newest one holding a checkpoint (``checkpoints.newest_checkpoint``
walks ``versions``); the sweep finds each grid point's newest run (``newest_version``), and
the report reads any tree of them. Two callbacks every run gets: ``ShareRunDir`` (every rank
writes into rank 0's folder) and ``RecordRun`` (``provenance.yaml``, the config in each
checkpoint).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import lightning as L

from macformer_lit import locks, provenance
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


# Rank 0's run folder, inherited by the ranks Lightning launches for DDP.
RUN_DIR_ENV = "MACFORMER_RUN_DIR"


class RunFolders:
    """This process's run folder (``path``) and the new folders it claimed: a run that fails
    before its first loop starts removes those again (``abandon``); once a loop has started
    (``keep``) they stay, with their checkpoints and NaN forensics."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.claimed: list[RunFolder] = []

    def take(self, exp_dir: Path, subcommand: str | None, *, resume: Path | None = None) -> Path:
        """The folder this process writes into: ``resume`` (a fit going on in place), rank
        0's, or a new ``version_<n>`` claimed by rank 0; locked by the one process that
        writes it."""
        if resume is not None:
            self.path = resume
        else:
            inherited = os.environ.get(RUN_DIR_ENV)
            if inherited and os.environ.get("LOCAL_RANK", "0") != "0":
                # A rank Lightning launched for DDP: rank 0 already claimed the folder.
                self.path = Path(inherited)
            elif launch_rank() != 0:
                # torchrun / SLURM: a guess that ShareRunDir replaces by rank 0's folder.
                self.path = version_folder(exp_dir, next_version(exp_dir))
            else:
                folder = RunFolder(exp_dir)
                self.claimed.append(folder)
                self.path = folder.claim()
                os.environ[RUN_DIR_ENV] = str(self.path)
        if os.environ.get("LOCAL_RANK", "0") == "0" and launch_rank() == 0:
            # One process writes a run folder; the other ranks write into rank 0's.
            locks.note(locks.hold(self.path, subcommand or "run"))
        return self.path

    def keep(self) -> None:
        for folder in self.claimed:
            folder.keep()

    @property
    def started(self) -> bool:
        """A resumed run claims no folder; a new one has started once a loop began."""
        return not self.claimed or any(f.kept for f in self.claimed)

    def unstarted(self) -> list[Path]:
        return [f.path for f in self.claimed if not f.kept and f.path is not None]

    def forget_started(self) -> None:
        """Treat every claimed folder as unstarted (an interrupted evaluation keeps nothing)."""
        for folder in self.claimed:
            folder.kept = False

    def abandon(self) -> None:
        for folder in self.claimed:
            folder.abandon()


def resume_command(argv: list[str]) -> str:
    """The command line that resumes ``argv``'s fit from its ``last.ckpt``."""
    kept, i = [], 0
    while i < len(argv):
        if argv[i] == "--ckpt_path":
            i += 2
            continue
        if not argv[i].startswith("--ckpt_path="):
            kept.append(argv[i])
        i += 1
    return shlex.join(["python", "-m", "macformer_lit", *kept, "--ckpt_path", "last"])


class ShareRunDir(L.Callback):
    """Every rank takes rank 0's run folder once the process group is up.

    Ranks that Lightning launches inherit the folder through ``MACFORMER_RUN_DIR``. Under
    torchrun or SLURM all ranks start at once and each guesses the next free
    ``version_<n>`` before any process group exists; only rank 0 creates its folder, and
    at setup it broadcasts the path, so that what the other ranks write (NaN forensics,
    sharded checkpoints) and the messages they print name the same folder.
    """

    def __init__(self, folders: RunFolders) -> None:
        self.folders = folders

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        shared = Path(trainer.strategy.broadcast(str(self.folders.path), src=0))
        if shared != self.folders.path:
            self.folders.path = shared
            # Private: the Trainer takes its folder when built, before any process group
            # can tell the other ranks rank 0's; Trainer.default_root_dir has no setter.
            trainer._default_root_dir = str(shared)

    # Once a loop starts, the folder holds the run (a failure later keeps it, with its
    # checkpoints and NaN forensics); before that, a failed start removes it (cli.main).
    def _started(self, *_) -> None:
        self.folders.keep()

    on_train_start = on_test_start = on_predict_start = _started

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._started()


class RecordRun(L.Callback):
    """``provenance.yaml``: one entry when this process's first loop starts (rank 0), so a
    run that fails to start records nothing; and every checkpoint carries the config it
    trained with, which a resume is compared with (``checkpoints.check_fits``)."""

    def __init__(
        self,
        folders: RunFolders,
        *,
        subcommand: str | None,
        argv: list[str],
        asked_precision: Any,
        checkpoint: dict | None,
        changes: list[dict],
        run_config: dict | None,
    ) -> None:
        self.folders = folders
        self.subcommand, self.argv, self.asked_precision = subcommand, argv, asked_precision
        self.checkpoint, self.changes, self.run_config = checkpoint, changes, run_config
        self.written = False

    def _record(self, trainer: L.Trainer, *_) -> None:
        if self.written or not trainer.is_global_zero:
            return
        self.written = True
        provenance.append(
            self.folders.path,
            provenance.entry(
                trainer,
                subcommand=self.subcommand,
                argv=self.argv,
                asked_precision=self.asked_precision,
                checkpoint=self.checkpoint,
                changes=self.changes,
            ),
        )

    on_train_start = on_test_start = on_predict_start = _record

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._record(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint[provenance.CHECKPOINT_KEY] = {
                "config": self.run_config,
                "precision": str(trainer.precision),
                "world_size": trainer.world_size,
            }
