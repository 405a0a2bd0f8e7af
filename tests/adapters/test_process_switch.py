"""The fork server's dead-man's switch with real children: a tree whose kill-by time is not renewed
dies on time with nobody's help; renewals keep it alive; a runner that fences first is not "stalled";
a runner's TERM after the switch's is not sent again. Checked from the child's own record."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.limits import Limits
from leasecore.process import Supervisor
from leasecore.process.forkserver.switches import FORKSERVER_NICE
from tests.support import wait_until

from .process_support import REPO, make_task, running_supervisor, spec

CHILD = str(REPO / "tests" / "integration" / "stall_child.py")
MARGIN = 0.4  # the fence margin: the tree must be gone by kill_at + this (the server's deadline)


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def record(path: Path) -> dict[str, list[float]]:
    events: dict[str, list[float]] = {"start": [], "term": [], "tick": []}
    for line in path.read_text().splitlines():
        kind, at = line.split()[:2]
        if kind in events:
            events[kind].append(float(at))
    terms = events["term"]  # one round of TERMs (group, then each member) counts once
    events["term"] = [t for i, t in enumerate(terms) if i == 0 or t - terms[i - 1] > 0.05]
    return events


def start(supervisor: Supervisor, path: Path, task_id: str, term_in: float, kill_in: float) -> object:
    now = time.monotonic()
    supervisor.kill_by.renew(task_id, (now + term_in, now + kill_in))
    task = make_task(task_id=task_id)
    child = supervisor.start(task, spec(sys.executable, CHILD, str(path)), worker_id="w")
    assert wait_until(lambda: path.exists() and "tick" in path.read_text(), 10)
    return child


def test_a_tree_nobody_renews_dies_by_its_kill_point_alone(supervisor: Supervisor, tmp_path: Path) -> None:
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-alone", 0.8, 1.3)
    term_at, kill_at = supervisor.kill_by._times["t-alone"]
    assert child.wait_gone(15)  # type: ignore[attr-defined]
    events = record(path)
    assert events["tick"][-1] <= kill_at + MARGIN  # dead before the server's deadline
    assert len(events["term"]) == 1 and events["term"][0] >= term_at  # one TERM, not before its point
    exit_ = child.wait(5)  # type: ignore[attr-defined]
    assert exit_ is not None and exit_.signal == signal.SIGKILL  # it ignored the TERM: the KILL ended it
    assert child.ended_by_switch  # type: ignore[attr-defined]
    assert 0 <= child.switch_late_seconds < MARGIN  # type: ignore[attr-defined]  # its KILL, on time
    assert supervisor.forkserver_stats()["switch_kills"] >= 1


def test_renewals_keep_the_tree_alive_and_its_end_follows_the_last_one(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-renewed", 0.8, 1.3)
    first_kill = supervisor.kill_by._times["t-renewed"][1]
    until = time.monotonic() + 2.5
    while time.monotonic() < until:  # a heartbeat acknowledged every 0.2 s
        now = time.monotonic()
        supervisor.kill_by.renew("t-renewed", (now + 0.8, now + 1.3))
        time.sleep(0.2)  # the heartbeat interval (a pace, not a wait for something to happen)
    last_kill = supervisor.kill_by._times["t-renewed"][1]
    assert not child.wait_gone(0)  # type: ignore[attr-defined]
    assert record(path)["tick"][-1] > first_kill + MARGIN  # it lived past the first kill-by time
    assert child.wait_gone(15)  # type: ignore[attr-defined]
    events = record(path)
    assert events["tick"][-1] <= last_kill + MARGIN
    assert child.ended_by_switch  # type: ignore[attr-defined]


def test_a_runner_that_fences_first_is_not_stalled_and_the_switch_still_bounds_the_kill(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-fenced", 0.8, 1.3)
    _, kill_at = supervisor.kill_by._times["t-fenced"]
    child.terminate_tree(grace_seconds=30.0)  # type: ignore[attr-defined]  # a grace past the kill point
    assert child.wait_gone(15)  # type: ignore[attr-defined]
    events = record(path)
    assert len(events["term"]) == 1  # the runner's TERM; the switch sent none
    assert events["tick"][-1] <= kill_at + MARGIN  # the switch's KILL point still held
    assert not child.ended_by_switch  # type: ignore[attr-defined]


def test_a_runners_term_after_the_switchs_is_not_sent_again(supervisor: Supervisor, tmp_path: Path) -> None:
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-late", 0.5, 2.5)
    assert wait_until(lambda: record(path)["term"], 10)  # the switch's TERM
    child.terminate_tree(grace_seconds=0.5)  # type: ignore[attr-defined]  # the runner, resuming late
    assert child.wait_gone(15)  # type: ignore[attr-defined]
    assert len(record(path)["term"]) == 1
    assert child.ended_by_switch  # type: ignore[attr-defined]
    assert supervisor.forkserver_stats()["switch_terms_withheld"] == 1


def test_a_tree_without_kill_by_times_has_no_switch(supervisor: Supervisor, tmp_path: Path) -> None:
    path = tmp_path / "rec"
    task = make_task(task_id="t-none")
    child = supervisor.start(task, spec(sys.executable, CHILD, str(path)), worker_id="w")
    assert wait_until(lambda: path.exists() and "tick" in path.read_text(), 10)
    assert not child.wait_gone(1.5)
    child.kill_tree()
    assert child.wait_gone(15)
    assert not child.ended_by_switch
    assert supervisor.forkserver_stats()["switch_terms"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="only a privileged fork server raises its priority")
def test_the_fork_server_runs_boosted_and_the_trees_do_not_inherit_it(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    assert os.getpriority(os.PRIO_PROCESS, supervisor.forkserver_pid) == FORKSERVER_NICE
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-nice", 30.0, 31.0)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == 0  # type: ignore[attr-defined]
    limited = spec("/bin/sleep", "30", limits=Limits(nofile=256))
    fork = supervisor.spawn(make_task(task_id="t-nice-fork"), limited, worker_id="w")
    assert os.getpriority(os.PRIO_PROCESS, fork.pid) == 0  # started by forkexec (rlimits): reset too
    for c in (child, fork):
        c.kill_tree()  # type: ignore[attr-defined]
        assert c.wait_gone(15)  # type: ignore[attr-defined]


def test_a_fork_server_stopped_while_the_runner_renews_kills_nothing_when_it_resumes(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    # Only the fork server stops (the runner runs and its heartbeats are acknowledged): when it
    # resumes, the renewals waiting on its socket are applied before any switch fires.
    path = tmp_path / "rec"
    child = start(supervisor, path, "t-fs-stopped", 2.0, 2.5)
    first_kill = supervisor.kill_by._times["t-fs-stopped"][1]
    os.kill(supervisor.forkserver_pid, signal.SIGSTOP)
    try:
        until = first_kill + 1.0  # stopped well past the first kill-by time
        while time.monotonic() < until:
            now = time.monotonic()
            supervisor.kill_by.renew("t-fs-stopped", (now + 2.0, now + 2.5))
            time.sleep(0.2)  # the heartbeat interval (a pace, not a wait for something to happen)
    finally:
        os.kill(supervisor.forkserver_pid, signal.SIGCONT)
    assert supervisor.kill_by.wait_sent(10)
    assert supervisor.forkserver_stats()["switch_terms"] == 0  # (served after the renewals)
    assert not child.wait_gone(0.5)  # type: ignore[attr-defined]
    assert record(path)["term"] == []
    child.kill_tree()  # type: ignore[attr-defined]
    assert child.wait_gone(15)  # type: ignore[attr-defined]
    assert not child.ended_by_switch  # type: ignore[attr-defined]
