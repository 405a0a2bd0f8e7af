"""update-v2 chaining end to end (leasecore.runner.chain): the real ``conductor-run run`` against the
embedded server, whose store records every claim and final update with the endpoint it came through.

Counts are exact: every task is claimed once and runs once (the children's own records), its one
final update lands, the runner never runs more children than its concurrency; a server without
update-v2 costs one refused call, then v1 for good; a task claimed as the runner stops goes straight
back and is re-polled at once; a re-delivery claimed through update-v2 is still held while its
previous holder may run it (two copies never overlap, from the copies' own records).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli import exitcodes
from leasecore.handover import YIELD_MARKER
from leasecore.server import EmbeddedServer
from leasecore.server.store import JSON, ApiError, Store
from tests.integration.helpers import World, wait_until
from tests.integration.test_handover_e2e import Copies

pytestmark = pytest.mark.slow


class ChainStore(Store):
    """A store that records claims (by poll or by update-v2) and updates, and can refuse or hold
    update-v2 calls."""

    def __init__(self) -> None:
        super().__init__()
        self.marks_lock = threading.Lock()
        self.claims: list[tuple[str, str, int]] = []  # (task id, "poll" | "v2", pollCount)
        self.updates: list[tuple[str, str, str]] = []  # (task id, status, "v1" | "v2"), no leases
        self.v2_calls = 0
        self.refuse_v2: int | None = None  # answer every update-v2 with this status, unapplied
        self.hold_v2: threading.Event | None = None  # set: update-v2 waits for it before it is applied
        self.v2_held = threading.Event()  # an update-v2 is waiting on hold_v2
        self._in_v2 = threading.local()

    def poll(self, task_type: str, *, count: int = 1, timeout_ms: int = 100, worker_id: str | None = None,
             domain: str | None = None) -> list[JSON]:
        got = super().poll(task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id, domain=domain)
        via = "v2" if getattr(self._in_v2, "active", False) else "poll"
        with self.marks_lock:
            self.claims.extend((str(t["taskId"]), via, int(t.get("pollCount") or 0)) for t in got)
        return got

    def update_task(self, body: Any) -> str:
        task_id = super().update_task(body)
        self._record(body, "v1")
        return task_id

    def update_task_v2(self, body: Any) -> JSON | None:
        with self.marks_lock:
            self.v2_calls += 1
        if self.refuse_v2 is not None:  # as a server without the endpoint: nothing applied
            raise ApiError(self.refuse_v2, "No static resource api/tasks/update-v2.")
        if self.hold_v2 is not None:
            self.v2_held.set()
            self.hold_v2.wait(30)
        self._in_v2.active = True
        try:
            claimed = super().update_task_v2(body)
        finally:
            self._in_v2.active = False
        self._record(body, "v2")
        return claimed

    def _record(self, body: Any, via: str) -> None:
        if isinstance(body, dict) and body.get("extendLease") is not True:
            with self.marks_lock:
                self.updates.append((str(body.get("taskId")), str(body.get("status")), via))

    def finals(self) -> list[tuple[str, str, str]]:
        with self.marks_lock:
            return [u for u in self.updates if u[1] != "IN_PROGRESS"]


@pytest.fixture
def chain_world(tmp_path: Path) -> Iterator[tuple[World, ChainStore]]:
    store = ChainStore()
    with EmbeddedServer(store=store) as server:
        w = World(tmp_path, server)
        try:
            yield w, store
        finally:
            w.close()


# Each run records its start and end (wall clock) and its task id and pollCount.
RECORD = 'echo "$CONDUCTOR_TASK_ID $CONDUCTOR_POLL_COUNT $(date +%s.%N)" >> "$1/start"; ' \
         'echo "$CONDUCTOR_TASK_ID $(date +%s.%N)" >> "$1/end"'


def read_runs(directory: Path) -> tuple[list[tuple[str, int, float]], dict[str, float]]:
    starts = [(t, int(n), float(at)) for t, n, at in
              (line.split() for line in (directory / "start").read_text().splitlines())]
    ends = {t: float(at) for t, at in (line.split() for line in (directory / "end").read_text().splitlines())}
    return starts, ends


def most_at_once(starts: list[tuple[str, int, float]], ends: dict[str, float]) -> int:
    edges = sorted([(at, 1) for _, _, at in starts] + [(at, -1) for at in ends.values()],
                   key=lambda e: (e[0], e[1]))
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def assert_no_two_copies(copies: Copies) -> list[Any]:
    """Copies of one task never overlap (those of different tasks may): each started after every
    earlier copy's last own record and exit."""
    seen = copies.read()
    for n, later in enumerate(seen):
        for earlier in (c for c in seen[:n] if c.task_id == later.task_id):
            assert earlier.last_alive < later.started, (earlier, later)
            assert earlier.exited is None or earlier.exited < later.started, (earlier, later)
    return seen


def stop(world: World, proc: Any) -> str:
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code in (exitcodes.SIGTERM, exitcodes.OK), err
    return err


def test_final_updates_claim_the_next_tasks_each_runs_once_within_the_concurrency(
    chain_world: tuple[World, ChainStore], tmp_path: Path
) -> None:
    world, store = chain_world
    world.define(response_timeout=30)
    runs = tmp_path / "runs"
    runs.mkdir()
    wfs = [world.start_workflow(x=i) for i in range(40)]
    proc = world.run("--concurrency", "3", command=["/bin/sh", "-c", RECORD, "job", str(runs)])
    wait_until(lambda: all(world.workflow_status(wf) == "COMPLETED" for wf in wfs), timeout_seconds=90,
               what="40 workflows", interval_seconds=0.25)
    stop(world, proc)
    starts, ends = read_runs(runs)
    task_ids = {str(world.task_of(wf)["taskId"]) for wf in wfs}
    assert sorted(t for t, _, _ in starts) == sorted(task_ids)  # every task ran, once
    assert all(n == 1 for _, n, _ in starts)
    assert most_at_once(starts, ends) <= 3  # the chained claims never outran the slots
    claims = Counter(t for t, _, _ in store.claims)
    assert set(claims) == task_ids and set(claims.values()) == {1}  # each claimed once, none lost
    finals = store.finals()
    assert Counter(t for t, _, _ in finals) == Counter({t: 1 for t in task_ids})
    assert {s for _, s, _ in finals} == {"COMPLETED"}
    by = Counter(via for _, via, _ in store.claims)
    assert by["v2"] >= 30, by  # after the first poll (3), the final updates claimed the rest
    assert not [u for u in store.updates if u[1] == "IN_PROGRESS"]  # nothing handed back


@pytest.mark.parametrize("code", [404, 405])
def test_a_server_without_update_v2_costs_one_refused_call_then_v1_for_good(
    chain_world: tuple[World, ChainStore], code: int, tmp_path: Path
) -> None:
    world, store = chain_world
    store.refuse_v2 = code
    world.define(response_timeout=30)
    runs = tmp_path / "runs"
    runs.mkdir()
    wfs = [world.start_workflow(x=i) for i in range(6)]
    proc = world.run("--concurrency", "1", command=["/bin/sh", "-c", RECORD, "job", str(runs)])
    wait_until(lambda: all(world.workflow_status(wf) == "COMPLETED" for wf in wfs), timeout_seconds=60,
               what="6 workflows", interval_seconds=0.25)
    err = stop(world, proc)
    assert store.v2_calls == 1  # the first final update only
    finals = store.finals()
    assert len(finals) == 6 and {via for _, _, via in finals} == {"v1"}
    assert {via for _, via, _ in store.claims} == {"poll"} and len(store.claims) == 6
    assert f"answered {code} to update-v2" in err and "from now on" in err
    assert err.count("from now on") == 1


def test_a_task_claimed_as_the_runner_stops_goes_straight_back(
    chain_world: tuple[World, ChainStore], tmp_path: Path
) -> None:
    """The first task's update-v2 is held at the server until the runner has begun to stop; the task
    it then claims is handed back unrun (IN_PROGRESS, callbackAfterSeconds 0, our yield marker) and is
    in the queue again at once, not after R (60 s); its next poll starts it without a wait."""
    world, store = chain_world
    store.hold_v2 = threading.Event()
    world.define(response_timeout=60)
    runs = tmp_path / "runs"
    runs.mkdir()
    first, second = world.start_workflow(x=1), world.start_workflow(x=2)
    proc = world.run("--concurrency", "1", command=["/bin/sh", "-c", RECORD, "job", str(runs)])
    assert store.v2_held.wait(30), "no update-v2 came"
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "received SIGTERM" in world.stderr(proc), what="the stop to begin")
    released = time.monotonic()
    store.hold_v2.set()
    code, err = world.finish(proc)
    assert code in (exitcodes.SIGTERM, exitcodes.OK), err
    starts, _ = read_runs(runs)
    assert [t for t, _, _ in starts] == [str(world.task_of(first)["taskId"])]  # the claimed one never ran
    back = world.task_of(second)
    assert back["status"] == "SCHEDULED" and back["outputData"].get(YIELD_MARKER) == 1, back
    assert ("v2" in {via for t, via, _ in store.claims if t == back["taskId"]})
    assert time.monotonic() - released < 10  # handed back at once, not held under a lease
    assert "as the runner began to stop; handing it back" in err
    # Its next delivery follows our yield: another runner starts it at once.
    store.hold_v2 = None
    proc = world.run("--once", command=["/bin/sh", "-c", RECORD, "job", str(runs)])
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    assert world.workflow_status(second) == "COMPLETED"
    assert "not starting it yet" not in err


def test_a_redelivery_claimed_by_update_v2_waits_for_its_previous_holder(
    chain_world: tuple[World, ChainStore], tmp_path: Path
) -> None:
    """A runs X; X is re-queued behind A's back (a bare IN_PROGRESS update); B, busy with Y, claims X
    (pollCount 2, no yield marker) with Y's final update-v2. B holds X until A must have fenced its
    TERM-ignoring copy: the copies never overlap (their own records)."""
    world, store = chain_world
    world.define(response_timeout=10)
    copies = Copies(tmp_path / "copies")
    config = tmp_path / "conductor.toml"
    config.write_text("[worker]\nownership_check_interval = 1\n")
    # Y finishes once its "done" file exists; X never does by itself (it ignores TERM).
    script = ('f="$1/$CONDUCTOR_TASK_ID.$$"; trap "" TERM; '
              'echo "start $(date +%s.%N) $$ $CONDUCTOR_POLL_COUNT" >> "$f"; '
              'while [ ! -e "$1/../done-$CONDUCTOR_TASK_ID" ]; do echo "alive $(date +%s.%N)" >> "$f"; '
              'sleep 0.01; done')
    command = ["/bin/sh", "-c", script, "copy", str(copies.dir)]
    x = world.start_workflow(x="x")
    a = world.run("--config", str(config), "--kill-grace", "1", command=command)
    wait_until(lambda: len(copies.read()) == 1, what="A's copy of X")
    y = world.start_workflow(x="y")
    b = world.run("--config", str(config), "--kill-grace", "1", command=command)
    wait_until(lambda: len(copies.read()) == 2, what="B's copy of Y")
    x_id, y_id = str(world.task_of(x)["taskId"]), str(world.task_of(y)["taskId"])
    world.client.request("POST", "/tasks", json_body={
        "taskId": x_id, "workflowInstanceId": x, "status": "IN_PROGRESS"}, accept="*/*")
    (tmp_path / f"done-{y_id}").touch()  # Y ends: its update-v2 claims X (B's one slot)
    wait_until(lambda: len(copies.read()) == 3, timeout_seconds=30, what="B's copy of X")
    assert_no_two_copies(copies)
    assert (x_id, "v2", 2) in store.claims  # X reached B through Y's final update
    wait_until(lambda: copies.read()[0].exited is not None, what="A's copy's exit to be seen")
    later = assert_no_two_copies(copies)
    assert [c.task_id for c in later] == [x_id, y_id, x_id] and later[2].poll_count == 2
    (tmp_path / f"done-{x_id}").touch()
    wait_until(lambda: world.workflow_status(x) == "COMPLETED", what="X to complete on B")
    for proc in (a, b):
        proc.send_signal(signal.SIGTERM)
    for proc in (a, b):
        world.finish(proc)
    assert "its previous holder may still run it" in world.stderr(b)
    assert "no longer ours" in world.stderr(a)


def test_a_chained_task_is_fenced_when_its_lease_runs_out(
    chain_world: tuple[World, ChainStore], tmp_path: Path
) -> None:
    """A task claimed through update-v2 holds a lease like a polled one: with the server out of reach
    its tree is killed before the lease deadline (no heartbeat acknowledged since the last one)."""
    world, store = chain_world
    world.define(response_timeout=4)
    quick = world.start_workflow(seconds=0)
    slow = world.start_workflow(seconds=60)
    with world.proxy() as proxy:
        proc = world.run("--kill-grace", "1", url=proxy.url_for("/api"))
        wait_until(lambda: world.workflow_status(quick) == "COMPLETED", what="the first task")
        slow_id = str(world.task_of(slow)["taskId"])
        wait_until(lambda: (slow_id, "v2", 1) in store.claims, what="the second claimed by update-v2")
        pids = wait_until(world.child_pids, what="the chained task's child")
        proxy.set_mode("blackhole")
        cut = time.monotonic()
        wait_until(lambda: "terminating the process tree (lease expired)" in world.stderr(proc),
                   timeout_seconds=15, what="the lease to run out")
        wait_until(lambda: not any(_alive(pid) for pid in pids), timeout_seconds=5, what="the tree to die")
        assert time.monotonic() - cut < 4 + 2  # within R of the cut (the lease counts from before it)
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code in (exitcodes.SIGTERM, exitcodes.OK), err
    assert [c for c in store.claims if c[0] == slow_id] == [(slow_id, "v2", 1)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
