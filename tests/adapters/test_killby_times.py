"""The runner's side of the switches (``KillByTimes``): renewals never wait for the fork server (a
stopped one must not hold up a heartbeat), only the latest times of each tree wait, in one request."""

from __future__ import annotations

import threading
import time
from typing import Any

from leasecore.errors import ProcessError
from leasecore.process.supervisor.killby import KillByTimes
from tests.support import wait_until


class StuckSocket:
    """A send that blocks until released, as to a fork server that does not read (SIGSTOPped)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.release.wait(30)
        self.sent.append(message)


def test_a_renewal_returns_at_once_while_the_fork_server_does_not_read() -> None:
    sock = StuckSocket()
    times = KillByTimes(sock.send)
    try:
        times.attach("a", "t1", None)
        times.attach("b", "t2", None)
        times.renew("a", (10.0, 11.0))  # taken by the sending thread, which now hangs in send
        wait_until(lambda: times._sending, 10)
        started = time.monotonic()
        for k in range(1000):  # heartbeats go on: each renewal only records
            times.renew("a", (20.0 + k, 21.0 + k))
            times.renew("b", (30.0 + k, 31.0 + k))
        assert time.monotonic() - started < 1.0
        assert times._due == {"t1": (1019.0, 1020.0), "t2": (1029.0, 1030.0)}  # only the latest wait
        sock.release.set()
        assert times.wait_sent(10)
        assert sock.sent == [
            {"op": "kill_by", "trees": [["t1", 10.0, 11.0]]},
            {"op": "kill_by", "trees": [["t1", 1019.0, 1020.0], ["t2", 1029.0, 1030.0]]},  # one request
        ]
    finally:
        sock.release.set()
        times.close()


def test_times_known_before_the_tree_go_out_once_it_is_attached_and_stop_when_the_lease_ends() -> None:
    sent: list[dict[str, Any]] = []
    times = KillByTimes(sent.append)
    try:
        times.renew("a", (10.0, 11.0))
        assert sent == [] and times.spawning("a") == [10.0, 11.0]
        times.renew("a", (12.0, 13.0))  # between the spawn request and attach
        times.attach("a", "t1", [10.0, 11.0])
        assert times.wait_sent(10)
        assert sent == [{"op": "kill_by", "trees": [["t1", 12.0, 13.0]]}]
        times.attach("b", "t2", None)  # a spawn with no times yet: the first ones come later
        times.renew("b", (5.0, 6.0))
        assert times.wait_sent(10) and sent[-1] == {"op": "kill_by", "trees": [["t2", 5.0, 6.0]]}
        times.renew("a", None)  # the lease is over
        times.renew("a", (99.0, 100.0))  # (a late one from another engine thread: no tree any more)
        times.gone("t2")
        times.renew("b", (7.0, 8.0))
        assert times.wait_sent(10) and len(sent) == 2
    finally:
        times.close()


def test_a_lost_fork_server_drops_the_renewal_quietly() -> None:
    def gone(message: dict[str, Any]) -> None:
        raise ProcessError("the fork server is gone")

    times = KillByTimes(gone)
    try:
        times.attach("a", "t1", None)
        times.renew("a", (1.0, 2.0))
        assert times.wait_sent(10)
        assert times.renewals == 1
    finally:
        times.close()
