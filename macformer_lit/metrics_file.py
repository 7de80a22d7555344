"""``metrics.csv``, written and read whole rows at a time.

A row cut by a kill mid-write, or rows of two processes mixed in one file, still parse:
a value cut from 0.0625 to 0.06 once reported 6.00 % for a run that had 6.25 %. The writer
(``loggers.RunCSVLogger``) appends rows in one write and replaces the file at once when its
header grows; ``read_metrics_rows`` (for ``report`` and ``sweep``) refuses a file that ends
inside a row or holds a row of the wrong length, naming the file and line. Kept free of
Lightning, so that ``report`` starts fast.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path


class MetricsFileError(ValueError):
    """A ``metrics.csv`` row that is not whole; the message names the file and line."""


def read_metrics_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a ``metrics.csv``, each checked whole: ``MetricsFileError`` names the
    file and line of a row with more or fewer fields than the header (cut short, or mixed
    with another writer's), or one the file ends inside."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise MetricsFileError(f"{path}: not UTF-8 text ({err.reason})") from None
    if "\n" in text and not text.endswith("\n"):
        raise MetricsFileError(
            f"{path}, line {text.count(chr(10)) + 1}: the file ends inside this row (its "
            "writer was stopped mid-row), so its last value may be cut short"
        )
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return []
        rows, start = [], reader.line_num + 1
        for fields in reader:
            if fields and len(fields) != len(header):
                raise MetricsFileError(
                    f"{path}, line {start}: {len(fields)} fields where the header has "
                    f"{len(header)}: a row cut short or mixed with another's; the run's "
                    "numbers cannot be trusted past it"
                )
            if fields:
                rows.append(dict(zip(header, fields)))
            start = reader.line_num + 1
    except csv.Error as err:
        raise MetricsFileError(f"{path}, line {reader.line_num}: not CSV ({err})") from None
    return rows


def csv_text(rows: list[list] | list[dict], fieldnames: list[str] | None = None) -> str:
    out = io.StringIO(newline="")
    if fieldnames is None:
        csv.writer(out).writerows(rows)
    else:
        csv.DictWriter(out, fieldnames=fieldnames).writerows(rows)
    return out.getvalue()


def append_whole(path: Path, text: str) -> None:
    """Append ``text`` (whole rows) in one write; on any failure (a full disk) the file is cut
    back to its old length, so that it never ends inside a row."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        data = memoryview(text.encode("utf-8"))
        try:
            while data:
                data = data[os.write(fd, data) :]
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def replace_whole(path: Path, text: str) -> None:
    """Write ``path`` anew through a temporary file renamed over it: a reader or a kill sees
    the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
