"""The embedded server's store and decider, driven directly with a FakeClock: no sockets, no sleeping."""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.clock import FakeClock
from leasecore.server.store import ApiError, Store, resolve_expressions


def _store(mode: str = "ideal") -> tuple[Store, FakeClock]:
    clock = FakeClock()
    return Store(clock=clock, sweep_mode="coarse" if mode == "coarse" else "ideal"), clock


def _setup(store: Store, **td: Any) -> str:
    body = {"name": "t", "responseTimeoutSeconds": 10, "retryCount": 0, "retryDelaySeconds": 0}
    body.update(td)
    store.register_task_defs([body])
    store.register_workflow_def(
        {"name": "w", "tasks": [{"name": "t", "taskReferenceName": "a"}]}, overwrite=True
    )
    return store.start_workflow("w", {})


def _poll(store: Store, worker: str = "w1") -> dict[str, Any]:
    got = store.poll("t", timeout_ms=0, worker_id=worker)
    assert len(got) == 1
    return got[0]


def _status(store: Store, task_id: str) -> str:
    status: str = store.get_task(task_id)["status"]
    return status


def _lease(store: Store, task: dict[str, Any]) -> None:
    store.update_task(
        {"taskId": task["taskId"], "workflowInstanceId": task["workflowInstanceId"], "extendLease": True}
    )


# ---------------------------------------------------------------------------------------------- timing


def test_response_timeout_fires_exactly_at_r_after_the_last_update() -> None:
    store, clock = _store()
    wf_id = _setup(store, responseTimeoutSeconds=10)
    task = _poll(store)
    assert store.next_due() == pytest.approx(clock.monotonic() + 10)
    clock.advance(9.999)
    assert store.run_due() == 0
    assert _status(store, task["taskId"]) == "IN_PROGRESS"
    clock.advance(0.001)
    assert store.run_due() == 1
    stored = store.get_task(task["taskId"])
    assert stored["status"] == "TIMED_OUT"
    assert stored["reasonForIncompletion"] == (
        f"responseTimeout: 10 exceeded for the taskId: {task['taskId']} with Task Definition: t"
    )
    assert store.get_workflow(wf_id)["status"] == "TIMED_OUT"
    assert store.next_due() is None


@pytest.mark.parametrize("start", [1000.0001234567, 1014.0009774336])
def test_a_timeout_due_now_is_decided_once_under_a_frozen_clock(start: float) -> None:
    """At these start times ``(t + R) - t < R`` in floating point: a schedule computing ``t + R`` and a
    decider testing ``now - t >= R`` disagreed, and ``run_due`` looked at the workflow again and again
    without the clock moving. The decider's looks are counted (a spin is cut at 50, never waited on)."""
    clock = FakeClock(start=start)
    store = Store(clock=clock)
    r = 30 if start == 1000.0001234567 else 10
    wf_id = _setup(store, responseTimeoutSeconds=r)
    task = _poll(store)
    sweeper = store._sweeper  # (the one place the timer loop's looks can be counted)
    decide, looks = sweeper._decide, []

    def counted(wf: Any, now: float) -> None:
        looks.append(now)
        if len(looks) > 50:
            raise AssertionError(f"run_due spins: {len(looks)} looks at a frozen {now!r}")
        decide(wf, now)

    sweeper._decide = counted
    clock.advance(r)
    assert store.next_due() == clock.monotonic()  # due exactly now
    assert (clock.monotonic() - start) < r  # the disagreement this test is about is there
    assert store.run_due() == 1
    assert looks == [clock.monotonic()]
    assert store.get_task(task["taskId"])["status"] == "TIMED_OUT"
    assert store.get_workflow(wf_id)["status"] == "TIMED_OUT"


def test_extend_lease_moves_the_deadline_and_nothing_else() -> None:
    store, clock = _store()
    _setup(store, responseTimeoutSeconds=10)
    task = _poll(store)
    clock.advance(8)
    _lease(store, task)
    assert store.next_due() == pytest.approx(clock.monotonic() + 10)
    clock.advance(8)
    assert store.run_due() == 0
    after = store.get_task(task["taskId"])
    assert after["status"] == "IN_PROGRESS"
    assert after["pollCount"] == 1
    assert after["updateTime"] == task["updateTime"] + 8000


def test_the_lost_update_switch_lets_a_heartbeat_undo_a_final_update_handled_between_its_read_and_write(
) -> None:
    # Given the real server's extendLease (read the task, write the whole copy back), and a final
    # COMPLETED update handled between that heartbeat's read and its write
    store, clock = _store()
    wf_id = _setup(store)
    task = _poll(store)
    done = {"taskId": task["taskId"], "workflowInstanceId": wf_id, "status": "COMPLETED",
            "outputData": {"answer": 42}, "workerId": "w1"}
    store.lease_write_back = lambda: store.update_task(done)
    clock.advance(1)
    _lease(store, task)
    # Then the workflow completed, but the task's record is IN_PROGRESS again, its output gone
    assert store.get_workflow(wf_id)["status"] == "COMPLETED"
    undone = store.get_task(task["taskId"])
    assert (undone["status"], undone["outputData"], undone["pollCount"]) == ("IN_PROGRESS", {}, 1)
    # and sending the result again is ignored: the workflow is terminal (CONDUCTOR_PROTOCOL.md §3)
    store.lease_write_back = None
    store.update_task(done)
    assert _status(store, task["taskId"]) == "IN_PROGRESS"


def test_without_the_switch_extend_lease_never_undoes_a_result() -> None:
    store, _clock = _store()
    wf_id = _setup(store)
    task = _poll(store)
    store.update_task({"taskId": task["taskId"], "workflowInstanceId": wf_id, "status": "COMPLETED",
                       "outputData": {"answer": 42}})
    _lease(store, task)
    assert store.get_task(task["taskId"])["outputData"] == {"answer": 42}
    assert _status(store, task["taskId"]) == "COMPLETED"


def test_epoch_fields_follow_the_injected_clock() -> None:
    store, clock = _store()
    _setup(store)
    clock.advance(2.5)
    task = _poll(store)
    assert task["startTime"] - task["scheduledTime"] == 2500
    assert task["updateTime"] == task["startTime"]


def test_in_progress_with_callback_requeues_after_the_delay() -> None:
    store, clock = _store()
    _setup(store)
    task = _poll(store)
    store.update_task(
        {
            "taskId": task["taskId"],
            "workflowInstanceId": task["workflowInstanceId"],
            "status": "IN_PROGRESS",
            "callbackAfterSeconds": 5,
        }
    )
    assert _status(store, task["taskId"]) == "SCHEDULED"
    clock.advance(4.9)
    assert store.poll("t", timeout_ms=0) == []
    clock.advance(0.1)
    again = _poll(store, "w2")
    assert again["taskId"] == task["taskId"]
    assert again["pollCount"] == 2
    assert again["startTime"] == task["startTime"]


@pytest.mark.parametrize(
    ("logic", "expected_delays"),
    [("FIXED", [4, 4, 4]), ("LINEAR_BACKOFF", [8, 16, 24]), ("EXPONENTIAL_BACKOFF", [4, 8, 16])],
)
def test_retry_delays(logic: str, expected_delays: list[int]) -> None:
    store, clock = _store()
    _setup(store, retryCount=3, retryDelaySeconds=4, retryLogic=logic, backoffScaleFactor=2)
    for delay in expected_delays:
        task = _poll(store)
        store.update_task(
            {"taskId": task["taskId"], "workflowInstanceId": task["workflowInstanceId"], "status": "FAILED"}
        )
        clock.advance(delay - 0.01)
        assert store.poll("t", timeout_ms=0) == []
        clock.advance(0.01)


def test_retry_copies_identity_and_resets_attempt_fields() -> None:
    store, clock = _store()
    wf_id = _setup(store, retryCount=1, responseTimeoutSeconds=3)
    task = _poll(store)
    clock.advance(3)
    store.run_due()
    retry = store.get_workflow(wf_id)["tasks"][1]
    assert retry["status"] == "SCHEDULED"
    assert retry["retryCount"] == 1
    assert retry["retriedTaskId"] == task["taskId"]
    assert retry["pollCount"] == 0
    assert retry["startTime"] == 0
    assert "workerId" not in retry
    assert store.get_task(task["taskId"])["retried"] is True


def test_timeout_policy_alert_only_does_not_rearm_forever() -> None:
    store, clock = _store()
    _setup(store, responseTimeoutSeconds=5, timeoutSeconds=5, timeoutPolicy="ALERT_ONLY")
    task = _poll(store)
    clock.advance(4)
    _lease(store, task)
    clock.advance(1)
    assert store.run_due() == 1  # the task timeout: alert only
    assert _status(store, task["taskId"]) == "IN_PROGRESS"
    assert store.next_due() == pytest.approx(clock.monotonic() + 4)  # only the response timeout is left


def test_poll_timeout_counts_from_scheduling() -> None:
    store, clock = _store()
    wf_id = _setup(store, pollTimeoutSeconds=3)
    clock.advance(3)
    store.run_due()
    assert store.get_workflow(wf_id)["status"] == "TIMED_OUT"


def test_total_timeout_spans_retries_and_stops_them() -> None:
    store, clock = _store()
    wf_id = _setup(
        store, retryCount=5, totalTimeoutSeconds=10, responseTimeoutSeconds=4, timeoutPolicy="RETRY"
    )
    _poll(store)
    clock.advance(4)
    store.run_due()  # response timeout: retry 1
    _poll(store)
    clock.advance(4)
    store.run_due()  # response timeout: retry 2
    _poll(store)
    clock.advance(2)
    store.run_due()  # total timeout: no retry afterwards
    wf = store.get_workflow(wf_id)
    assert wf["status"] == "TIMED_OUT"
    assert [t["status"] for t in wf["tasks"]] == ["TIMED_OUT"] * 3


def test_workflow_timeout_seconds() -> None:
    store, clock = _store()
    store.register_workflow_def(
        {
            "name": "wt",
            "timeoutSeconds": 7,
            "timeoutPolicy": "TIME_OUT_WF",
            "tasks": [{"name": "t", "taskReferenceName": "a"}],
        }
    )
    wf_id = store.start_workflow("wt", {})
    clock.advance(7)
    store.run_due()
    wf = store.get_workflow(wf_id)
    assert wf["status"] == "TIMED_OUT"
    assert wf["tasks"][0]["status"] == "CANCELED"


def test_optional_task_failure_lets_the_workflow_continue() -> None:
    store, _ = _store()
    store.register_workflow_def(
        {
            "name": "opt",
            "tasks": [
                {
                    "name": "t",
                    "taskReferenceName": "a",
                    "optional": True,
                    "taskDefinition": {"name": "t", "retryCount": 0},
                },
                {"name": "u", "taskReferenceName": "b"},
            ],
        }
    )
    wf_id = store.start_workflow("opt", {})
    task = _poll(store)
    store.update_task({"taskId": task["taskId"], "workflowInstanceId": wf_id, "status": "FAILED"})
    assert store.get_task(task["taskId"])["status"] == "COMPLETED_WITH_ERRORS"
    assert len(store.poll("u", timeout_ms=0)) == 1


# ---------------------------------------------------------------------------------------------- coarse mode


def test_coarse_mode_first_check_on_time_later_ones_60_to_120_s_late() -> None:
    store, clock = _store("coarse")
    wf_id = _setup(store, responseTimeoutSeconds=10)
    task = _poll(store)
    t0 = clock.monotonic()
    assert store.next_due() == pytest.approx(t0 + 10)  # the first check is on time
    clock.advance(5)
    _lease(store, task)  # the worker heartbeats at +5, then dies
    assert store.next_due() == pytest.approx(t0 + 10)  # still the first, on-time visit ...
    clock.advance(5)
    assert store.run_due() == 1  # ... which sees the fresh heartbeat and re-arms
    assert _status(store, task["taskId"]) == "IN_PROGRESS"
    requested = t0 + 15
    due = store.next_due()
    assert due is not None
    assert requested + 60 < due <= requested + 120
    clock.advance(due - clock.monotonic() - 0.01)
    store.run_due()
    assert _status(store, task["taskId"]) == "IN_PROGRESS"  # the ideal deadline passed long ago
    clock.advance(0.01)
    store.run_due()
    assert _status(store, task["taskId"]) == "TIMED_OUT"
    assert store.get_workflow(wf_id)["status"] == "TIMED_OUT"


def test_explicit_decide_is_immediate_in_coarse_mode() -> None:
    store, clock = _store("coarse")
    wf_id = _setup(store, responseTimeoutSeconds=10)
    task = _poll(store)
    clock.advance(5)
    _lease(store, task)
    clock.advance(5)
    store.run_due()
    clock.advance(5)
    store.decide(wf_id)
    assert _status(store, task["taskId"]) == "TIMED_OUT"


# ---------------------------------------------------------------------------------------------- rules


def test_update_rules_in_order() -> None:
    store, _ = _store()
    wf_id = _setup(store)
    task = _poll(store)
    with pytest.raises(ApiError) as bad:
        store.update_task({"taskId": "", "workflowInstanceId": wf_id, "status": "COMPLETED"})
    assert bad.value.status == 400
    with pytest.raises(ApiError) as missing_wf:
        store.update_task({"taskId": task["taskId"], "workflowInstanceId": "nope", "status": "COMPLETED"})
    assert missing_wf.value.status == 404
    assert "workflow" in missing_wf.value.message
    with pytest.raises(ApiError) as bad_enum:
        store.update_task({"taskId": task["taskId"], "workflowInstanceId": wf_id, "status": "TIMED_OUT"})
    assert bad_enum.value.status == 500
    with pytest.raises(ApiError) as no_status:
        store.update_task({"taskId": task["taskId"], "workflowInstanceId": wf_id})
    assert no_status.value.status == 500
    assert (
        store.update_task(
            {
                "taskId": task["taskId"],
                "workflowInstanceId": wf_id,
                "status": "COMPLETED",
                "logs": [{"log": str(i)} for i in range(15)],
            }
        )
        == task["taskId"]
    )
    assert len(store.get_logs(task["taskId"])) == 10


def test_long_poll_over_five_seconds_is_rejected() -> None:
    store, _ = _store()
    with pytest.raises(ApiError) as err:
        store.poll("t", timeout_ms=5001)
    assert err.value.status == 400


def test_task_def_validation_collects_every_error() -> None:
    store, _ = _store()
    with pytest.raises(ApiError) as err:
        store.register_task_defs([{"name": "", "retryCount": -1, "responseTimeoutSeconds": 0}])
    assert err.value.status == 400
    assert err.value.validation_errors is not None
    assert len(err.value.validation_errors) == 3


def test_workflow_defs_of_non_simple_tasks_are_refused() -> None:
    store, _ = _store()
    with pytest.raises(ApiError) as err:
        store.register_workflow_def(
            {"name": "x", "tasks": [{"name": "h", "taskReferenceName": "h", "type": "HTTP"}]}
        )
    assert err.value.status == 400


def test_task_to_domain_uses_the_first_active_domain() -> None:
    store, clock = _store()
    store.register_workflow_def({"name": "d", "tasks": [{"name": "t", "taskReferenceName": "a"}]})
    store.poll("t", timeout_ms=0, domain="live")  # a worker polls "live"
    wf1 = store.start_workflow("d", {}, task_to_domain={"t": "dead,live"})
    assert store.get_workflow(wf1)["tasks"][0]["domain"] == "live"
    wf2 = store.start_workflow("d", {}, task_to_domain={"*": "dead,NO_DOMAIN"})
    assert "domain" not in store.get_workflow(wf2)["tasks"][0]
    clock.advance(11)  # "live" is no longer active: the last entry wins
    wf3 = store.start_workflow("d", {}, task_to_domain={"t": "live,other"})
    assert store.get_workflow(wf3)["tasks"][0]["domain"] == "other"


def test_expressions() -> None:
    ctx = {"workflow": {"input": {"a": {"b": [1, 2]}, "s": "x"}}, "ref": {"output": {"y": True}}}
    template = {
        "whole": "${workflow.input.a}",
        "nested": "${workflow.input.a.b.1}",
        "text": "s=${workflow.input.s} y=${ref.output.y}",
        "missing": "${ref.output.nope}",
        "list": ["${ref.output.y}", 3],
        "plain": "no expression",
    }
    assert resolve_expressions(template, ctx) == {
        "whole": {"b": [1, 2]},
        "nested": 2,
        "text": "s=x y=true",
        "missing": None,
        "list": [True, 3],
        "plain": "no expression",
    }


# ---------------------------------------------------------------------------------------------- bounds


def _complete(store: Store, wf_id: str) -> str:
    task = _poll(store)
    assert task["workflowInstanceId"] == wf_id
    store.update_task({"taskId": task["taskId"], "workflowInstanceId": wf_id, "status": "COMPLETED"})
    store.add_log(task["taskId"], "done")
    return str(task["taskId"])


def _gone(call: Any, *args: Any) -> bool:
    with pytest.raises(ApiError) as info:
        call(*args)
    return info.value.status == 404


def test_only_the_newest_finished_workflows_are_kept_and_running_ones_never_go() -> None:
    clock = FakeClock()
    store = Store(clock=clock, max_finished_workflows=3)
    running = [_setup(store) for _ in range(5)]  # queued first: each poll below takes the oldest
    finished = [(wf_id, _complete(store, wf_id)) for wf_id in running[:4]]
    terminated = store.start_workflow("w", {})
    store.terminate_workflow(terminated, "enough")

    # 5 finished (4 completed, 1 terminated), 3 kept: the two that finished first are forgotten.
    for wf_id, task_id in finished[:2]:
        assert _gone(store.get_workflow, wf_id)
        assert _gone(store.get_workflow_status, wf_id)
        assert _gone(store.get_task, task_id)
        assert store.get_logs(task_id) == []
        assert _gone(store.update_task, {"taskId": task_id, "workflowInstanceId": wf_id, "extendLease": True})
    for wf_id, task_id in finished[2:]:
        assert store.get_workflow(wf_id)["status"] == "COMPLETED"
        assert [e["log"] for e in store.get_logs(task_id)] == ["done"]
    assert store.get_workflow(terminated)["status"] == "TERMINATED"
    assert store.get_workflow(running[4])["status"] == "RUNNING"
    assert store.evicted_workflows == 2

    # A timed-out workflow counts as finished too (ended by the timer, not a call).
    _poll(store)  # running[4]'s task, R = 10 s
    clock.advance(10)
    assert store.run_due() == 1
    assert store.get_workflow(running[4])["status"] == "TIMED_OUT"
    assert _gone(store.get_workflow, finished[2][0])
    assert store.evicted_workflows == 3


def test_the_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Store(max_finished_workflows=0)
    with pytest.raises(ValueError, match="at least 1"):
        Store(max_logs_per_task=0)


def test_a_task_keeps_only_its_latest_log_entries() -> None:
    store = Store(clock=FakeClock(), max_logs_per_task=5)
    _setup(store)
    task = _poll(store)
    for i in range(12):
        store.add_log(task["taskId"], f"line {i}")
    store.update_task(
        {
            "taskId": task["taskId"],
            "workflowInstanceId": task["workflowInstanceId"],
            "status": "IN_PROGRESS",
            "logs": [{"log": "from the update"}],
        }
    )
    logs = [e["log"] for e in store.get_logs(task["taskId"])]
    assert logs == ["line 8", "line 9", "line 10", "line 11", "from the update"]


def test_logs_for_ids_that_are_no_task_here_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import leasecore.server.storestate as state

    monkeypatch.setattr(state, "MAX_UNKNOWN_LOG_TASKS", 3)
    store = Store(clock=FakeClock())
    for i in range(5):
        store.add_log(f"stranger-{i}", "hello")
    assert [store.get_logs(f"stranger-{i}") != [] for i in range(5)] == [False, False, True, True, True]


def test_poll_data_forgets_the_least_recently_polled_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    import leasecore.server.storestate as state

    monkeypatch.setattr(state, "MAX_POLL_DATA_ENTRIES", 2)
    store = Store(clock=FakeClock())
    for task_type in ("a", "b", "a", "c"):
        store.poll(task_type, timeout_ms=0, worker_id="w")
    assert [entry["queueName"] for entry in store.poll_data(None)] == ["a", "c"]


def test_polls_of_types_nothing_was_scheduled_for_leave_no_queue_behind() -> None:
    store, _ = _store()
    wf = _setup(store)
    for i in range(500):  # a typo, a scanner: any name can be polled
        assert store.poll(f"nobody_{i}", timeout_ms=0) == []
    assert store.queue_sizes() == {"t": 1}  # only the queue a task was scheduled in
    assert _poll(store)["workflowInstanceId"] == wf
    assert store.queue_sizes() == {"t": 0}  # drained, but kept: tasks of this type were queued

