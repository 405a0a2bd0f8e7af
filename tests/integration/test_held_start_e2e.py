"""A held re-delivery is read back before it starts, end to end (a real runner, the embedded server,
copies that record their own life; see test_handover_e2e.py).

The previous holder's late FAILED (an update carries no pollCount) lands on the re-delivered task
while the new holder holds it, after the held lease's last ownership check and before the hold ends.
Without the read-back, the new holder started a copy of a task that was over (and whose retry the
server had created at once). This test plays the previous holder itself (it polled the task first
and reports the FAILED), so the timing is the test's, not a second runner's.
"""

from __future__ import annotations

import time
from pathlib import Path

from leasecore.checkbudget import max_queue_seconds
from tests.integration.helpers import World
from tests.integration.test_handover_e2e import Copies, stop
from tests.support import wait_until

CHECK_EVERY = 30  # the new holder's ownership checks: one at most in the first interval, the next after it


def test_a_held_redelivery_whose_previous_holder_failed_it_meanwhile_is_never_started(
    world: World, tmp_path: Path
) -> None:
    world.define(responseTimeoutSeconds=120, retry_count=1)
    copies = Copies(tmp_path / "copies")
    config = tmp_path / "conductor.toml"
    config.write_text(f"[worker]\nownership_check_interval = {CHECK_EVERY}\n")
    wf = world.start_workflow()
    (first,) = world.client.poll(world.task_type, count=1, timeout_ms=1000, worker_id="previous-holder")
    assert first.poll_count == 1
    world.client.request("POST", "/tasks", json_body={  # re-queued while "previous-holder" runs it
        "taskId": first.task_id, "workflowInstanceId": wf, "status": "IN_PROGRESS"}, accept="*/*")
    b = world.run("--config", str(config), "--kill-grace", "2", command=copies.command())
    wait_until(lambda: "not starting it yet" in world.stderr(b), timeout_seconds=30,
               what="B to hold the re-delivery")
    held_at = time.monotonic()
    # B's hold: the check interval + 0.5 + G + 0.4 (+ twice its check budget's queue) after the poll.
    # Its lease's first check falls within the first interval, the next one a whole interval later:
    # a FAILED landing just after the first interval is seen only by the read-back at the hold's end.
    hold = CHECK_EVERY + 0.5 + 2 + 0.4 + 2 * max_queue_seconds(1, 20.0)
    time.sleep(max(0.0, held_at + CHECK_EVERY + 0.5 - time.monotonic()))  # (the scenario's timing)
    assert time.monotonic() - held_at < hold - 1.0, "the machine was too slow to land it in the hold"
    world.client.request("POST", "/tasks", json_body={
        "taskId": first.task_id, "workflowInstanceId": wf, "status": "FAILED", "workerId": "previous-holder",
        "reasonForIncompletion": "lease expired"}, accept="*/*")
    wait_until(lambda: "no longer ours" in world.stderr(b), timeout_seconds=hold + 10,
               what="B to find the task no longer ours")
    wait_until(lambda: copies.read(), timeout_seconds=30, what="B to run the retry the FAILED created")
    stop(world, b)
    ran = copies.read()
    assert [c for c in ran if c.task_id == first.task_id] == [], "B started a copy of a task that was over"
    assert all(c.task_id != first.task_id for c in ran) and len(ran) == 1  # the retry, once
