"""The cgroup tests' daemons (``tests.daemons.Daemon``) are found by a command line of their own.

Two runs of the suite on one machine used to share ``sleep 3319``: each found (and killed) the other's
daemons. Here two daemons of the same base, as two overlapping runs would make, run side by side: each
finds only its own process, and killing one leaves the other running.
"""

from __future__ import annotations

import subprocess

from tests.daemons import Daemon
from tests.support import wait_until


def test_two_daemons_of_one_base_find_and_kill_only_their_own() -> None:
    ours, theirs = Daemon(3319), Daemon(3319)
    assert ours.argv != theirs.argv
    assert ours.argv[1].startswith("3319.") and ours.shell == f"sleep {ours.argv[1]}"
    procs = [subprocess.Popen(daemon.argv) for daemon in (ours, theirs)]
    try:
        # sleep takes the marked argv as seconds: both keep running, each seen once, by its own Daemon.
        wait_until(lambda: len(ours.running()) == 1 and len(theirs.running()) == 1, 10, "both daemons")
        assert [p.pid for p in ours.running()] == [procs[0].pid]
        assert [p.pid for p in theirs.running()] == [procs[1].pid]
        ours.kill_all()
        assert procs[0].wait(5) == -9
        assert procs[1].poll() is None and [p.pid for p in theirs.running()] == [procs[1].pid]
        theirs.kill_all()
        assert procs[1].wait(5) == -9
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
