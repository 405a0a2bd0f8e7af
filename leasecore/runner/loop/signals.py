"""Signal capture: handlers only record, the main loop acts.

A handler can run between any two bytecodes of the main thread (while it holds a logging lock, or
half-way through writing a state file), so it must not log, lock, do I/O or kill anything. Here it
only calls ``on_signal(signum, count)``, which the runner makes a ``SimpleQueue.put`` (documented as
reentrant, i.e. safe from a signal handler). ``count`` is how many of the captured signals arrived
so far, so the runner can treat the second one as "force". SIGHUP is not a stop: it asks for a
reload (``on_reload()``, also a queue put), and is ignored where nobody reloads.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
RELOAD_SIGNAL = signal.SIGHUP

_Handler = Callable[[int, FrameType | None], object] | int | None


@contextmanager
def capture_signals(
    on_signal: Callable[[int, int], None], signals: tuple[signal.Signals, ...] = SHUTDOWN_SIGNALS,
    *, on_reload: Callable[[], None] | None = None,
) -> Iterator[bool]:
    """Route ``signals`` to ``on_signal(signum, count)`` inside the block; restore the old handlers after.
    With ``on_reload``, SIGHUP goes to ``on_reload()`` (not counted as a stop).

    Yields ``True`` when the handlers were installed, ``False`` when they could not be (not on the main
    thread, e.g. a runner driven by a test thread): then only pushed events stop the runner.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    count = 0

    def handle(signum: int, _frame: FrameType | None) -> None:
        nonlocal count
        count += 1
        on_signal(signum, count)

    def reload(_signum: int, _frame: FrameType | None) -> None:
        if on_reload is not None:
            on_reload()

    previous: dict[signal.Signals, _Handler] = {}
    mask: set[int | signal.Signals] | None = None
    handled = (*signals, RELOAD_SIGNAL) if on_reload is not None else signals
    try:
        for sig in signals:
            previous[sig] = signal.signal(sig, handle)
        if on_reload is not None:
            previous[RELOAD_SIGNAL] = signal.signal(RELOAD_SIGNAL, reload)
        # A mask passes through exec: started with these blocked (by whatever started us), we would
        # never see a stop.
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
        yield True
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, old in previous.items():
            signal.signal(sig, old)


class SignalRelay:
    """An ``on_signal`` for ``capture_signals`` whose target can change while the handlers stay installed.

    The worker keeps its handlers from the first line of setup to the last line of cleanup, so a
    signal never kills the process half-way (children and status files left behind). Before the
    runner exists and after it returned, signals are only recorded (``first``, ``count``); while it
    runs they go to ``target`` (the runner's ``handle_signal``), counted from the first one, so the
    second signal of the process is always the "force" one. Handler-safe: it only assigns attributes
    and calls ``target``, which must be reentrant (``SimpleQueue.put``).
    """

    def __init__(self) -> None:
        self.first: int | None = None  # the first signal received, if any
        self.count = 0
        self.target: Callable[[int, int], None] | None = None
        self.reload_target: Callable[[], None] | None = None  # SIGHUP while the runner runs
        self._interrupting = False

    def reload(self) -> None:
        """SIGHUP: to ``reload_target`` while the runner runs; before and after it, ignored (the
        configuration was just read, or the run is over)."""
        target = self.reload_target
        if target is not None:
            target()

    def __call__(self, signum: int, count: int) -> None:
        self.count = count
        if self.first is None:
            self.first = signum
        target = self.target
        if target is not None:
            target(signum, count)
        elif self._interrupting:
            self._interrupting = False  # one raise per block: a second signal must not cut the unwinding
            raise StartupInterrupted(signum)

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Inside the block, a signal (or one already received) raises ``StartupInterrupted`` in the
        main thread, out of whatever blocking call it is in: for a start-up step that holds no
        resource worth finishing (the server check waits up to its timeout on a silent server)."""
        self._interrupting = True
        try:
            if self.first is not None:
                raise StartupInterrupted(self.first)
            yield
        finally:
            self._interrupting = False


class StartupInterrupted(BaseException):
    """A signal cut a start-up step short (see ``SignalRelay.interrupting``). A ``BaseException``, like
    ``KeyboardInterrupt``, so that the ``except Exception`` of an HTTP client cannot swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
