"""Generated files are written whole: staged under a temporary name, then renamed.

Stdlib only, so that generator workers (spawned) import it cheaply.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Generated files are written under a temporary name in their own folder and renamed into
# place (``os.replace`` is atomic), so a reader never sees half a file; the name carries the
# writer's PID, so a later start can tell a dead writer's leftovers (SIGKILL, power loss)
# from a live writer's (another DDP rank) and remove only those.
_TEMPORARY = re.compile(
    r"^\..+\.tmp-(?P<a>\d+)$"  # .<name>.tmp-<pid>: staging_path, checkpoints
    r"|^.+\.(?P<b>\d+)\.tmp$"  # <name>.<pid>.tmp: ListOps staging before 2026-12
    r"|^.+\.tmp(?P<c>\d+)$"  # <name>.tmp<pid>: token caches, tokenizers
)


def staging_path(path: Path | str) -> Path:
    """Where ``path`` is written before it is renamed over it."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(folder: Path | str) -> list[Path]:
    """Remove the temporary files in ``folder`` whose writer is no longer running."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for path in entries:
        m = _TEMPORARY.match(path.name)
        if not m or not path.is_file():
            continue
        pid = int(m.group("a") or m.group("b") or m.group("c"))
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def write_whole(path: Path | str, text: str) -> None:
    """``path`` holds ``text`` entirely or keeps what it held: written, then renamed."""
    path = Path(path)
    tmp = staging_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
