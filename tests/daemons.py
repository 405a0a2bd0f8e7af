"""Daemons a test starts on purpose, found again by a command line that no other test or test run shares.

The cgroup tests start a daemon that leaves its session and wipes its environment (``setsid env -i``):
nothing of the runner's tracking names it any more, so the test finds it on the machine by its
command line. A fixed one (``sleep 3319``) was shared by every run of the suite on the host: two
overlapping runs (two checkouts, two CI jobs, two engineers) each saw the other's daemons (a
``(daemon,) = ...`` unpacking two) and killed them at teardown. Each ``Daemon`` has its own:
``sleep <base>.<nine random digits>``, which sleep reads as seconds, so the marker is the argv itself
and survives ``env -i`` and every re-parenting.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.support import wait_until


class Daemon:
    """One test's daemon command: its argv, its shell form, and the processes running it now."""

    def __init__(self, base_seconds: int = 3300) -> None:
        self.argv = ["sleep", f"{base_seconds}.{secrets.randbelow(10**9):09d}"]

    @property
    def shell(self) -> str:
        """The command as a shell line (its words need no quoting)."""
        return " ".join(self.argv)

    def running(self) -> list[psutil.Process]:
        """Live processes (anyone's, zombies left out) running exactly this command line."""
        found = []
        for process in psutil.process_iter(["cmdline", "status"]):
            if process.info["cmdline"] == self.argv and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process)
        return found

    def kill_all(self, timeout_seconds: float = 5.0) -> None:
        """KILL every process running this command line; fails if one is still there after the timeout."""
        for process in self.running():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        wait_until(lambda: not self.running(), timeout_seconds, what=f"no process left running {self.shell}")


def own_daemon(base_seconds: int) -> Any:
    """A fixture for a test module (assign it to ``daemon_cmd``): each test gets a ``Daemon`` of its
    own, and whatever still runs its command line is killed after the test."""

    @pytest.fixture
    def daemon_cmd() -> Iterator[Daemon]:
        daemon = Daemon(base_seconds)
        yield daemon
        daemon.kill_all()

    return daemon_cmd
