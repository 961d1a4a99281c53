"""Stopping a long run: Ctrl-C and the signals schedulers send (SIGTERM; SLURM's SIGUSR1 warning; SIGHUP when
the terminal goes) all mean "checkpoint, say so in one line, exit 128 + the signal's number".

The command line turns each stop signal into a KeyboardInterrupt, as Python does for SIGINT (`stops_interrupt`).
Loops that checkpoint take the signals themselves (`StopGuard`): they stop between steps, never inside one, so
that the checkpoint written on the way out holds a whole number of steps and the same command resumes exactly.
`SaveClock` says when a checkpoint is due by elapsed time, beside the step count. No torch here: the command
line installs this before it imports anything heavy.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

# The signals that stop a run as Ctrl-C does (those this platform has: Windows lacks SIGHUP and SIGUSR1).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1") if hasattr(signal, n))
SAVE_MINUTES = 5.0  # at most this long between checkpoints, by default
_last = [signal.SIGINT]  # the last stop signal received in this process (for the exit code and the message)


def stopped_by() -> str:
    """What a one-line stop message says of the signal: nothing for Ctrl-C, "SIGTERM: " for the others."""
    return "" if _last[0] == signal.SIGINT else f"{signal.Signals(_last[0]).name}: "


def exit_code() -> int:
    """The shell's code for a process stopped by the last stop signal: 128 + its number (130 for Ctrl-C)."""
    return 128 + int(_last[0])


def _install(handler) -> dict | None:
    """Point every stop signal at `handler` and return the handlers it replaced (None off the main thread,
    where Python cannot set handlers). A signal ignored on entry stays ignored: `nohup` ignores SIGHUP, and a
    shell ignores SIGINT for a job it starts in the background, so that those runs go on. A KeyboardInterrupt
    raised with no signal since counts as Ctrl-C."""
    _last[0] = signal.SIGINT
    if threading.current_thread() is not threading.main_thread():
        return None
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}


def _restore(previous: dict | None) -> None:
    for s, h in (previous or {}).items():
        signal.signal(s, h)


def _raise_interrupt(signum, frame) -> None:
    _last[0] = signum
    raise KeyboardInterrupt


@contextlib.contextmanager
def stops_interrupt():
    """For the block (the whole of a CLI command): every stop signal raises KeyboardInterrupt, as SIGINT does."""
    previous = _install(_raise_interrupt)
    try:
        yield
    finally:
        _restore(previous)


class StopGuard:
    """A stop signal during a loop of steps: `requested` is set; KeyboardInterrupt is raised at once only while
    `interruptible` (work that can be thrown away, such as a forward and backward pass), never while the state
    a checkpoint holds is being changed, so that state is always that after a whole number of steps."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.interruptible = False
        self._previous: dict | None = None

    def handler(self, signum, frame) -> None:
        _last[0] = signum
        first = not self.requested.is_set()
        self.requested.set()
        if first and self.interruptible:
            raise KeyboardInterrupt

    def install(self) -> "StopGuard":
        self._previous = _install(self.handler)
        return self

    def restore(self) -> None:
        _restore(self._previous)
        self._previous = None


class SaveClock:
    """When a checkpoint is due by time: `due()` once `minutes` have passed since the start or the last `saved()`.
    Time decides only when to save, never what: a checkpoint holds whole steps either way."""

    def __init__(self, minutes: float = SAVE_MINUTES, name: str = "checkpoint_minutes") -> None:
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not 0 < minutes < float("inf"):
            raise ValueError(f"{name} (the minutes between checkpoints) must be a finite number > 0, got {minutes!r}")
        self.seconds = 60.0 * minutes
        self.saved()

    def saved(self) -> None:
        self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.seconds


@contextlib.contextmanager
def deferred_stops():
    """A block a stop signal does not cut (files written together): the signal is acted on after it, as a
    KeyboardInterrupt, so the files are all the old ones or all the new ones."""
    guard = StopGuard().install()
    try:
        yield
    finally:
        guard.restore()
    if guard.requested.is_set():
        raise KeyboardInterrupt
