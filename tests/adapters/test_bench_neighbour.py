"""bench/neighbour.py: the busy process the ``throughput-busy`` section runs beside the workers."""

from __future__ import annotations

import os

import psutil

from bench.neighbour import busy_process
from tests.support import wait_until


def test_the_busy_process_spins_in_its_own_session_and_is_gone_after_the_block() -> None:
    with busy_process() as pid:
        loop = psutil.Process(pid)
        assert os.getsid(pid) == pid != os.getsid(0)  # its own session: its own autogroup
        assert wait_until(lambda: sum(loop.cpu_times()[:2]) >= 0.05, 10)  # it burns CPU
    assert not psutil.pid_exists(pid)  # killed and reaped
