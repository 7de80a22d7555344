"""One writer per folder: a run's ``version_<n>`` and a sweep's folder are locked while in use.

Two ``fit --ckpt_path last`` of one experiment at once both resumed ``version_0`` and wrote
interleaved rows into its ``metrics.csv``. ``hold(folder)`` takes an exclusive ``flock`` on
``folder/.lock`` for as long as the process runs there and writes the holder (PID, host,
what, since when) into it; a second process stops with one line naming that PID
(``FolderInUse``). The kernel drops a ``flock`` when its process dies, so a lock left by a
killed process is free: the next holder finds the dead one's line still in the file and says
that it takes the folder over. ``release_all`` (``cli.main``, the sweep, process exit) empties
the file, which stays (unlinking a lock file lets two processes lock two different files).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from pathlib import Path

from macformer_lit.preflight import UsageError

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no locking
    fcntl = None

LOCK_FILE = ".lock"


class FolderInUse(UsageError):
    """Another live process holds the folder; the message (``.code``) names it."""


# Folder (resolved) -> (open lock file, pid that took it); a second hold is a no-op.
_HELD: dict[Path, tuple] = {}


def holder(folder: Path) -> str:
    """The recorded holder of ``folder``'s lock ("" when none is recorded)."""
    try:
        return (Path(folder) / LOCK_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _describe(line: str) -> str:
    """``PID 123 (fit, since 10:02:03)`` from a lock file's ``pid host what since`` line."""
    parts = line.split(" ", 3)
    if len(parts) < 4 or not parts[0].isdigit():
        return f"another process ({line!r})" if line else "another process"
    pid, host, what, since = parts
    where = "" if host == socket.gethostname() else f" on {host}"
    return f"PID {pid}{where} ({what}, since {since})"


def hold(folder: str | os.PathLike, what: str) -> str | None:
    """Lock ``folder`` for this process until ``release``/``release_all`` or exit.

    Raises ``FolderInUse`` naming the live holder. Returns a note when the lock of a process
    that ended without releasing it (killed) was taken over, else None."""
    folder = Path(folder)
    key = folder.resolve()
    if fcntl is None or key in _HELD:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / LOCK_FILE, "a+", encoding="utf-8")
    except OSError:
        return None  # not writable: the run's own writes will say so
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        line = f.read().strip()
        f.close()
        raise FolderInUse(
            f"{folder} is in use by {_describe(line)}: one process writes a folder at a "
            "time; wait for that one to end, or stop it"
        ) from None
    except OSError:
        f.close()
        return None  # a file system without locks: carry on unlocked, as before
    f.seek(0)
    stale = f.read().strip()
    f.seek(0)
    f.truncate()
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(f"{os.getpid()} {socket.gethostname()} {what} {since}\n")
    f.flush()
    _HELD[key] = (f, os.getpid())
    if stale and not stale.startswith(f"{os.getpid()} "):
        return f"{folder}: taken over from {_describe(stale)}, which ended without releasing it"
    return None


def release(folder: str | os.PathLike) -> None:
    held = _HELD.pop(Path(folder).resolve(), None)
    if held is None:
        return
    f, pid = held
    if pid == os.getpid():  # not in a forked child, which shares the parent's lock
        try:
            f.seek(0)
            f.truncate()  # an empty lock file: released cleanly, nobody to take over from
        except OSError:
            pass  # the folder was removed (an abandoned run): closing is all that is left
    f.close()


def release_all() -> None:
    for folder in list(_HELD):
        release(folder)


atexit.register(release_all)


def note(message: str | None) -> None:
    if message:
        print(f"macformer_lit: note: {message}", file=sys.stderr, flush=True)
