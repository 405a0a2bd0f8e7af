"""Embedded server, prompt timing in the default "ideal" mode (embedded-only: the real server is coarse).

Latencies are read from the server's own timestamps (startTime/endTime/updateTime), so a loaded test
machine cannot make them flaky; the bounds are still generous.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil

from leasecore.server import EmbeddedServer
from tests.conformance.harness import Harness
from tests.support import wait_until


def test_response_timeout_fires_promptly_without_any_decide(api: Harness) -> None:
    task_type, wf = api.one_task_workflow(responseTimeoutSeconds=1, retryCount=0)
    api.start(wf)
    task = api.poll_one(task_type)
    timed_out = wait_until(
        lambda: (t := api.task(task["taskId"]))["status"] == "TIMED_OUT" and t, 10, "the response timeout"
    )
    lateness_ms = timed_out["endTime"] - (task["updateTime"] + 1000)
    assert 0 <= lateness_ms < 300


def test_heartbeats_keep_it_alive_and_the_timeout_follows_the_last_one(api: Harness) -> None:
    task_type, wf = api.one_task_workflow(responseTimeoutSeconds=1, retryCount=0)
    api.start(wf)
    task = api.poll_one(task_type)
    api.keep_alive(task, seconds=2.0, every=0.3)
    last_beat = api.task(task["taskId"])["updateTime"]
    assert api.task(task["taskId"])["status"] == "IN_PROGRESS"
    timed_out = wait_until(
        lambda: (t := api.task(task["taskId"]))["status"] == "TIMED_OUT" and t, 10, "the response timeout"
    )
    assert 0 <= timed_out["endTime"] - (last_beat + 1000) < 300


def test_a_waiting_long_poll_gets_a_new_task_at_once(server: EmbeddedServer, api: Harness) -> None:
    task_type, wf = api.one_task_workflow()
    got: list[dict[str, Any]] = []
    baseline = server.open_connections
    other = Harness(api.url, "embedded")  # its own connection, so the count below is the poll's

    def long_poll() -> None:
        try:
            got.extend(other.poll_batch(task_type, timeout_ms=5000))
        finally:
            other.close()

    poller = threading.Thread(target=long_poll)
    poller.start()
    wait_until(lambda: server.open_connections > baseline, 10, "the long poll to be waiting")
    api.start(wf)
    poller.join(timeout=10)
    assert len(got) == 1
    assert got[0]["startTime"] - got[0]["scheduledTime"] < 100


def test_a_waiting_long_poll_gets_a_delayed_retry_when_it_is_due(api: Harness) -> None:
    task_type, wf = api.one_task_workflow(retryCount=1, retryDelaySeconds=1, responseTimeoutSeconds=30)
    api.start(wf)
    first = api.poll_one(task_type)
    api.update(first, "FAILED")
    got: list[dict[str, Any]] = []
    poller = threading.Thread(target=lambda: got.extend(api.poll_batch(task_type, timeout_ms=4000)))
    poller.start()
    poller.join(timeout=10)
    assert len(got) == 1
    retry = got[0]
    wait_ms = retry["startTime"] - retry["scheduledTime"]
    assert 1000 <= wait_ms < 1300


def test_idle_server_with_pending_deadlines_and_waiting_polls_does_not_spin() -> None:
    with EmbeddedServer() as srv:
        api = Harness(srv.url, "embedded")
        task_type, wf = api.one_task_workflow(responseTimeoutSeconds=3600)
        for _ in range(20):
            api.start(wf)
        for _ in range(10):
            api.poll_one(task_type)  # 10 leases with far deadlines, 10 tasks queued
        pollers = [
            threading.Thread(target=api.poll_batch, args=(api.unique("idle"),), kwargs={"timeout_ms": 3000})
            for _ in range(10)
        ]
        for p in pollers:
            p.start()
        wait_until(lambda: srv.open_connections >= 10, 10, "the idle long polls")
        me = psutil.Process()
        before = me.cpu_times()
        time.sleep(1.0)  # a measurement window, not a wait for an event
        after = me.cpu_times()
        for p in pollers:
            p.join(timeout=10)
        api.close()
    busy = (after.user - before.user) + (after.system - before.system)
    assert busy < 0.2
