"""The late-heartbeat scenario, shared by the embedded-server and the real-server end-to-end tests.

A proxy between the runner and the server holds each task's first heartbeat (as a congested network
or a partition does) and lets it through together with that task's next update. The server's
extendLease is a read-modify-write of the whole task (CONDUCTOR_PROTOCOL.md §3): the held heartbeat's
stale IN_PROGRESS copy can land after the final update, and the task's record then says IN_PROGRESS,
without its output, inside a COMPLETED workflow. The scenario ends by reading every workflow and its
task back from the server: the outcome is the server's records, not the runner's log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.integration.helpers import World


@dataclass(frozen=True)
class LateBeatOutcome:
    """What the server holds at the end, per workflow, and what the runner said."""

    records: dict[str, dict[str, Any]]  # workflow id -> {"workflow": status, "task": the task's record}
    held: int  # heartbeats the proxy held
    released: int  # held heartbeats that went on together with their task's update
    stderr: str
    exit_code: int

    def summary(self, workflow_ids: list[str]) -> list[str]:
        """One line per workflow: its status, its task's status and output, for an assertion's message."""
        lines = []
        for wf in workflow_ids:
            task = self.records[wf]["task"]
            lines.append(f"{wf}: workflow {self.records[wf]['workflow']}, task {task.get('taskId')} "
                         f"{task.get('status')}, output {task.get('outputData')}")
        return lines

    def undone(self) -> list[str]:
        """Workflows whose task record disagrees with them (a RUNNING workflow whose only task is
        IN_PROGRESS counts) or lost its output."""
        return [wf for wf, r in self.records.items()
                if r["task"].get("status") != r["workflow"]
                or "slept" not in (r["task"].get("outputData") or {})]


def run_late_beat_scenario(world: World, *, tasks: int, seconds: float, response_timeout: int,
                           kill_grace: float, args: tuple[str, ...] = (),
                           command: list[str] | None = None, concurrency: int | None = None,
                           hold_every: int = 1) -> LateBeatOutcome:  # fmt: skip
    """``tasks`` one-task workflows whose children sleep ``seconds``, run at once by one runner behind a
    proxy that holds each task's first heartbeat until its next update; returns the server's records
    once the runner has ended (``--max-tasks``). ``args`` / ``command``: the runner's extra
    options and the command (default: the sleeper, which writes ``{"slept": seconds}``);
    ``concurrency`` below ``tasks``: the first tasks' final updates claim the next (update-v2);
    ``hold_every``: hold the first heartbeat of every n-th task only."""
    world.define(response_timeout=response_timeout)
    workflows = [world.start_workflow(seconds=seconds) for _ in range(tasks)]
    with world.proxy() as proxy:
        proxy.hold_heartbeats(every=hold_every)
        proc = world.run("--concurrency", str(concurrency or tasks), "--max-tasks", str(tasks),
                         "--kill-grace", str(kill_grace), *args, url=proxy.url_for("/api"),
                         command=command)  # fmt: skip
        code, err = world.finish(proc, timeout=seconds * 4 + response_timeout * 4 + 60)
        held, released = len(proxy.held), len(proxy.released)

    # Every final update was acknowledged before the runner ended, and the server decides the workflow
    # inside the update: what it holds now is final (a RUNNING workflow is an undone task's).
    records = {}
    for wf in workflows:
        doc = world.admin.get_workflow(wf)
        records[wf] = {"workflow": doc["status"], "task": dict((doc.get("tasks") or [{}])[-1])}
    return LateBeatOutcome(records, held, released, err, code)
