"""Error triage: how a failed ``fit``/``validate``/``test``/``predict`` ends.

A mistake the user can fix is one ``macformer_lit: error: ...`` line and exit code 2 (our
own ``ValueError``/``OSError``/``FloatingPointError`` under jsonargparse's wrapping, a
usage error, an unknown config, a full disk); a stop signal is one line and 128 + the
signal; anything else keeps its traceback. Either way a run folder whose run never
started a loop is removed first, and the W&B run is closed quietly, so the error is the
last line printed.
"""

from __future__ import annotations

import contextlib
import io
import sys
import typing
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from macformer_lit import interrupts
from macformer_lit.config_lookup import ConfigNotFound
from macformer_lit.loggers import finish_wandb_quietly
from macformer_lit.preflight import UsageError, disk_full
from macformer_lit.runs import RunFolders, resume_command

PACKAGE_DIR = Path(__file__).resolve().parent
LIGHTNING_DIR = Path(L.__file__).resolve().parent


def exit_for(err: BaseException, *, argv: list[str], subcommand: str, folders: RunFolders) -> None:
    """Raise the ``SystemExit`` that ends the run failed with ``err``; return when ``err``
    is not one the user can fix (the caller re-raises it, with its traceback).
    ``subcommand``: the one asked for, or ``run``."""
    abandon_unstarted(folders)
    # W&B's closing lines ("You can sync this run ...") would print after the error.
    if isinstance(err, SIGTERMException):
        # Stopped on purpose, last.ckpt saved: preempted, the shell's code for the signal.
        code = interrupts.exit_code(getattr(err, "stop_signal", 15))
        finish_wandb_quietly(code, preempted=True)
        raise SystemExit(code) from None
    finish_wandb_quietly()
    if isinstance(err, ConfigNotFound):
        print(err.code, file=sys.stderr)
        raise SystemExit(2) from None
    if isinstance(err, interrupts.Interrupted):
        interrupted(err, argv=argv, subcommand=subcommand, folders=folders)
    if isinstance(err, UsageError):
        print(f"macformer_lit: error: {err.code}", file=sys.stderr)
        raise SystemExit(2) from None
    user_error = (
        our_error(err) if isinstance(err, (ValueError, OSError, FloatingPointError)) else None
    )
    if user_error is None:
        # Lightning's or torch's writes too: one line.
        user_error = disk_full(err, started=folders.started)
    if user_error is None:
        return
    print(f"macformer_lit: error: {user_error}", file=sys.stderr)
    raise SystemExit(2) from None


def interrupted(
    err: interrupts.Interrupted, *, argv: list[str], subcommand: str, folders: RunFolders
) -> typing.NoReturn:
    """One line for a stop signal outside a graceful fit loop, and 128 + the signal. An
    interrupted ``validate``/``test``/``predict`` leaves no folder: it scored nothing whole."""
    started = folders.started
    if subcommand != "fit":
        folders.forget_started()
        abandon_unstarted(folders)
        what = f"{subcommand} interrupted ({err.name}); nothing was kept"
    elif started:
        what = (
            f"fit interrupted ({err.name}) without saving; it goes on from its last checkpoint "
            f"with: {resume_command(argv)}"
        )
    else:
        what = f"fit interrupted ({err.name}) before training started; nothing was kept"
    with contextlib.suppress(OSError, ValueError):
        print(f"macformer_lit: {what}", file=sys.stderr, flush=True)
    raise SystemExit(err.exit_code) from None


def abandon_unstarted(folders: RunFolders) -> None:
    """Remove the run folders of a run that failed before any loop started, closing the
    offline W&B run inside first (its closing lines would bury the error)."""
    unstarted = folders.unstarted()
    if not unstarted:
        return
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    inside = run is not None and any(
        Path(run.dir).resolve().is_relative_to(f.resolve()) for f in unstarted
    )
    if inside:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            wandb.finish(exit_code=1)
    folders.abandon()


def raised_under(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` was raised by code in ``folder`` (its traceback's last frame)."""
    tb, last = err.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and Path(last).resolve().is_relative_to(folder)


def our_error(err: BaseException) -> BaseException | None:
    """The deepest error in ``err``'s chain that this package raised on purpose (bad
    config values, missing or malformed data, NaN forensics), or None for anything else.

    jsonargparse wraps errors raised while building the model or DataModule in a
    "Does not validate against any of the Union subtypes" message; the user needs only
    ours.
    """
    found = None
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        ours = raised_under(err, PACKAGE_DIR)
        if ours and isinstance(err, (ValueError, OSError, FloatingPointError)):
            found = err
        # ``raise ... from None`` replaced its context with a message of its own.
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return found
