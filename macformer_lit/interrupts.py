"""Signals and closed streams, handled one way for every subcommand.

``install`` (called first thing by ``cli.main``) makes SIGINT, SIGTERM and SIGHUP raise
``Interrupted`` in this process, so ``finally`` blocks run (staged data files are removed,
an unstarted run folder is abandoned) and ``cli.main`` ends with one line and the shell's
exit code (128 + the signal). ``Interrupted`` is not a ``KeyboardInterrupt`` on purpose:
Lightning answers a ``KeyboardInterrupt`` inside a loop with its own message and exit 1.
While a fit trains, ``callbacks.preemption.SaveOnSigterm`` asks for a graceful stop
instead (``graceful``): the loop stops at the next boundary and saves ``last.ckpt``.
Child processes forked from this one (data workers, generator pools) keep the default
behaviour: the parent decides.

A handler's exception is lost where Python cannot raise (an at-fork hook, a finaliser, a
weakref callback: it prints "Exception ignored" and goes on). A signal landing while a
generator pool forks its workers did exactly that, and the fit trained on; so ``install``
also sets ``sys.unraisablehook``: an ``Interrupted`` lost that way is delivered again, and
the handler runs again at the next point where its exception can propagate.

``forgiving_streams`` keeps a closed stdout or stderr (``fit ... | head -3``, a closed
terminal) from failing a run: the first write that finds the reader gone points the stream
at ``/dev/null`` and the run goes on, as it would with its output discarded.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
SIGNALS = tuple(NAMES)

_main_pid: int | None = None
_previous_unraisablehook = None
# Set while a fit loop runs with SaveOnSigterm: a signal then asks for a graceful stop.
graceful = None


class Interrupted(BaseException):
    """A stop signal reached this process outside a graceful fit loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, f"signal {signum}"))
        self.signum = signum

    @property
    def name(self) -> str:
        return NAMES.get(self.signum, f"signal {self.signum}")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def _handler(signum, frame) -> None:
    if os.getpid() != _main_pid:
        # A forked child (DataLoader worker, generator pool): the default action.
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)
        return
    if graceful is not None:
        graceful(signum)
        return
    raise Interrupted(signum)


def _deliver_after_hook(signum: int) -> None:
    """Send ``signum`` to the main thread once it has left ``_unraisable``: sent from the
    hook itself, the handler would run at once, in the hook, and its exception be lost."""
    main = threading.main_thread().ident
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code is not _unraisable.__code__:
            frame = frame.f_back
        if frame is None:
            break
        time.sleep(0.001)
    os.kill(_main_pid, signum)


def _unraisable(hook) -> None:
    """An ``Interrupted`` raised where Python could not propagate it: deliver the signal
    again (its handler then runs at the next point that can raise); anything else goes to
    the hook that was there before."""
    exc = hook.exc_value
    if isinstance(exc, Interrupted) and os.getpid() == _main_pid:
        threading.Thread(target=_deliver_after_hook, args=(exc.signum,), daemon=True).start()
        return
    (_previous_unraisablehook or sys.__unraisablehook__)(hook)


def install() -> dict:
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` in this (main) process; returns the
    handlers they had, for ``restore``."""
    global _main_pid, _previous_unraisablehook
    if threading.current_thread() is not threading.main_thread():
        return {}
    _main_pid = os.getpid()
    if sys.unraisablehook is not _unraisable:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _unraisable
    previous = {}
    for signum in SIGNALS:
        old = signal.getsignal(signum)
        if old is signal.SIG_IGN and signum != signal.SIGINT:
            continue  # nohup and friends: ignoring was asked for
        previous[signum] = old
        signal.signal(signum, _handler)
    return previous


def restore(previous: dict) -> None:
    global graceful
    graceful = None
    if sys.unraisablehook is _unraisable:
        sys.unraisablehook = _previous_unraisablehook or sys.__unraisablehook__
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def ignore_in_worker() -> None:
    """Initializer for pool workers: the parent handles a Ctrl-C sent to the whole group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


class _ForgivingStream:
    """A text stream whose reader may go away: writes after that go to /dev/null."""

    _GONE = (errno.EPIPE, errno.EIO, errno.ENXIO, errno.EBADF)

    def __init__(self, stream) -> None:
        self._stream = stream
        self._closed_reader = False

    def _gone(self) -> None:
        self._closed_reader = True
        try:
            # Later writes, and the interpreter's flush at exit, go nowhere quietly.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text):
        if self._closed_reader:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as err:
            if err.errno not in self._GONE:
                raise
            self._gone()
            return len(text)

    def flush(self) -> None:
        if self._closed_reader:
            return
        try:
            self._stream.flush()
        except OSError as err:
            if err.errno not in self._GONE:
                raise
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def forgiving_streams() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ForgivingStream):
            try:
                stream.fileno()
            except (OSError, ValueError, AttributeError):
                continue  # not a file (captured by a test or a notebook): leave it
            setattr(sys, name, _ForgivingStream(stream))
