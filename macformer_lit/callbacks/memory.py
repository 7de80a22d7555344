"""Give the host memory that freed tensors leave behind back to the operating system.

Why a long CPU run grew until it was killed (docs/pitfalls.md §5, with the measurements).
PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves large blocks
with ``mmap`` at first, but every time such a block is freed it raises its threshold for
``mmap`` to that block's size (up to 32 MiB on 64-bit), so from the first steps on, nearly
every activation of a Transformer step is carved out of the heap instead. When every batch
has another shape (length-bucketed batches, or batches padded to their own longest
sequence), the freed blocks never fit the next step's requests exactly: the heap fragments,
and glibc keeps the freed pages resident because they do not lie at its top. Nothing is
leaked (Python holds no reference), yet the resident size only grows.

Two fixes, at that cause:

- The DataModules pad every batch to a multiple of 64 tokens (``pad_to_multiple_of``), so
  a run meets a bounded set of shapes (about ``max_len / 64``) and the heap's free blocks
  fit again.
- This callback calls ``malloc_trim(0)`` after every training, validation and test epoch,
  which hands the free pages of every heap back to the system (``madvise``): the resident
  size falls back to the live memory before the next phase, whose batches have other
  shapes. ``every_n_steps`` trims during training too; it is off by default because
  trimming costs a page fault for every page used again, and on its own (without the
  rounding) it does not stop the peak from rising between trims.

Fixing glibc's ``mmap`` threshold instead (``mallopt``) keeps memory flat too but makes
every large tensor a fresh zeroed mapping, which is slower.

Only glibc has ``malloc_trim``; elsewhere (macOS, musl) this callback does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import lightning as L


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_host_memory() -> bool:
    """Return the C heap's free pages to the OS; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class ReleaseHostMemory(L.Callback):
    """``malloc_trim`` after each training, validation and test epoch, and every
    ``every_n_steps`` training batches if that is above 0 (the default 0 trims only after
    epochs)."""

    def __init__(self, every_n_steps: int = 0) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(
                "ReleaseHostMemory every_n_steps must be an integer >= 0 (0: only after each "
                f"epoch); got {every_n_steps!r}"
            )
        self.every_n_steps = every_n_steps
        self._batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batches += 1
        if self.every_n_steps and self._batches % self.every_n_steps == 0:
            release_host_memory()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        release_host_memory()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        release_host_memory()

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        release_host_memory()
