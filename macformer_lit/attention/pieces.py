"""Eager CPU work over the batch in pieces (docs/pitfalls.md §2).

glibc serves every block over 32 MiB as a fresh zeroed ``mmap`` and unmaps it on free, so a
temporary of that size costs a page fault per 4 KiB page in every step, and a chain of
elementwise passes over it reads and writes main memory each time. Run over the leading
(batch) dimension in pieces of ``PIECE_BYTES``, the temporaries of one piece stay on the
heap and in cache. This module holds that one decision (the size, and where pieces are
used) for the Maclaurin map (features.py) and ppSBN (ppsbn.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Bytes of one piece's largest temporary. A few MB: on the heap (below glibc's mmap
# threshold) and within a CPU's last-level cache.
PIECE_BYTES = 4 << 20

_whole = False


@contextlib.contextmanager
def whole_batch() -> Iterator[None]:
    """Inside, every pass runs over the whole batch, as it does off the CPU: what a GPU
    keeps, measured on a CPU (``benchmarks/train_step.py --whole-batch``). Results are the
    same bits either way; only time and memory change."""
    global _whole
    before, _whole = _whole, True
    try:
        yield
    finally:
        _whole = before


def batch_slices(t: torch.Tensor, bytes_per_entry: int | None = None) -> list[slice]:
    """Slices of dim 0 of ``t`` whose temporaries are ≤ ``PIECE_BYTES`` each (at least one
    entry a piece); ``bytes_per_entry`` is one entry's largest temporary (default: one
    entry of ``t``). One ``slice(None)`` when pieces would not help: off the CPU (a GPU's
    caching allocator has no page faults to save, and every piece costs kernel launches),
    under torch.compile (the compiler fuses the passes itself; ``out=`` into slices would
    break the graph), inside ``whole_batch()``, or when the whole fits in one piece."""
    whole = [slice(None)]
    if _whole or t.device.type != "cpu" or t.dim() < 2 or torch.compiler.is_compiling():
        return whole
    n = t.shape[0]
    if bytes_per_entry is None:
        bytes_per_entry = t[:1].numel() * t.element_size()
    step = max(1, PIECE_BYTES // max(bytes_per_entry, 1))
    if n <= step:
        return whole
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]
