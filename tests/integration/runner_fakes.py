"""Small fakes for driving the runner: an in-memory Conductor, a lease engine, real child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from leasecore.errors import ConductorUnavailable
from leasecore.lease import (
    FenceAction,
    FenceReason,
    KillTree,
    LeasePolicy,
    LeaseState,
    LeaseView,
    TerminateTree,
)
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.spec import ChildExit, CommandSpec
from leasecore.snapshot import ServerHealth, TaskSnapshot, TaskState


def make_task(task_id: str, task_type: str = "t", **kw: Any) -> Task:
    return Task(
        task_id=task_id,
        workflow_id=f"wf-{task_id}",
        task_type=task_type,
        response_timeout_seconds=kw.pop("response_timeout_seconds", 30),
        **kw,
    )


class FakeConductor:
    """Tasks waiting per type, updates and logs recorded; ``fail_updates`` makes updates fail."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.queued: dict[str, list[Task]] = {}
        self.updates: list[TaskResult] = []
        self.logs: dict[str, list[str]] = {}
        self.polls = 0
        self.fail_updates = False
        self.failed_updates = 0  # update calls refused while fail_updates was set
        self.refuse: Callable[[TaskResult], Exception | None] = lambda result: None  # its error is raised
        self.refused: list[TaskResult] = []
        self.fail_polls = False
        self.poll_error: Exception | None = None  # raised by every poll while set
        self.stuck = threading.Event()  # set: polls hang (past their timeout) until it is cleared

    def add(self, *tasks: Task) -> None:
        with self._cond:
            for task in tasks:
                self.queued.setdefault(task.task_type, []).append(task)
            self._cond.notify_all()

    def poll(
        self,
        task_type: str,
        *,
        count: int,
        timeout_ms: int,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[Task]:
        with self._cond:
            self.polls += 1
            if self.fail_polls:
                raise ConductorUnavailable("connection refused")
            if self.poll_error is not None:
                raise self.poll_error
            while self.stuck.is_set():  # a server that accepted the poll and never answers
                self._cond.wait(0.05)
            self._cond.wait_for(lambda: bool(self.queued.get(task_type)), timeout=timeout_ms / 1000)
            waiting = self.queued.get(task_type, [])
            got, self.queued[task_type] = waiting[:count], waiting[count:]
            return got

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        if self.fail_updates:
            with self._cond:
                self.failed_updates += 1
            raise ConductorUnavailable("connection refused")
        error = self.refuse(result)
        if error is not None:
            with self._cond:
                self.refused.append(result)
            raise error
        with self._cond:
            self.updates.append(result)

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None:
        with self._cond:
            self.logs.setdefault(task_id, []).extend(text.split("\n"))

    def statuses(self) -> dict[str, TaskStatus]:
        with self._cond:
            return {u.task_id: u.status for u in self.updates}


@dataclass
class FakeEngine:
    """Records the runner's calls; fences on shutdown like the real engine (at once or at the deadline)."""

    on_fence: Callable[[str, FenceAction], None]
    calls: list[tuple[str, str]] = field(default_factory=list)
    reasons: dict[str, FenceReason] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    tracked: set[str] = field(default_factory=set)  # leases held: view() raises KeyError for others
    on_track: Callable[[Task], None] = lambda task: None  # called on the tracking thread, unlocked
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.calls.append(("start", ""))

    def stop(self) -> None:
        self.calls.append(("stop", ""))

    def track(self, task: Task, policy: LeasePolicy, *, polled_at: float | None = None) -> None:
        with self.lock:
            self.calls.append(("track", task.task_id))
            self.live.add(task.task_id)
            self.tracked.add(task.task_id)
        self.on_track(task)

    def start_held(self, task_id: str) -> None:
        self.calls.append(("start_held", task_id))

    def child_started(self, task_id: str) -> None:
        self.calls.append(("child_started", task_id))

    def child_exited(self, task_id: str) -> FenceReason | None:
        with self.lock:
            self.calls.append(("child_exited", task_id))
            self.live.discard(task_id)
            return self.reasons.get(task_id)

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        with self.lock:  # the lease ends, and its fence with it (the real engine forgets both)
            self.calls.append(("reported", task_id))
            self.tracked.discard(task_id)
            self.reasons.pop(task_id, None)

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool:
        self.calls.append(("begin_final_update", task_id))
        return True

    def late_beats(self, task_id: str) -> None:
        return None  # its beats never go out: none has an unknown fate

    def final_update_failed(self, task_id: str) -> None:
        self.calls.append(("final_update_failed", task_id))

    def fence(self, task_id: str, reason: FenceReason, *, kill: bool = False) -> None:
        with self.lock:
            self.reasons.setdefault(task_id, reason)
        self.on_fence(task_id, KillTree(reason) if kill else TerminateTree(reason))

    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None:
        self.calls.append(("shutdown", str(drain_deadline)))

        def fence_all() -> None:
            for tid in list(self.live):
                self.fence(tid, FenceReason.SHUTDOWN)

        if drain_deadline is None:
            fence_all()
        else:
            timer = threading.Timer(max(0.0, drain_deadline - time.monotonic()), fence_all)
            timer.daemon = True
            timer.start()

    def fence_reason(self, task_id: str) -> FenceReason | None:
        return self.reasons.get(task_id)

    def lease_times(self, task_id: str) -> tuple[FenceReason | None, float | None, float | None] | None:
        try:  # (through view: a subclass's deadlines count here too)
            view = self.view(task_id)
        except KeyError:
            return None
        return self.fence_reason(task_id), view.lease_deadline, view.hard_deadline

    def view(self, task_id: str) -> LeaseView:
        with self.lock:
            if task_id not in self.tracked:
                raise KeyError(task_id)
        return LeaseView(
            polled_at=0.0,
            last_ack_at=None,
            next_heartbeat_at=None,
            lease_deadline=None,
            hard_deadline=None,
            exec_deadline=None,
            consecutive_failures=0,
            heartbeat_in_flight=False,
            state=LeaseState.RUNNING,
            fence_reason=None,
        )

    def names(self, task_id: str) -> list[str]:
        return [name for name, tid in self.calls if tid == task_id]


def python_spec(source: str) -> CommandSpec:
    """The command ``sys.executable -c SOURCE``, as a task type's spec (what ``FakeSupervisor`` runs)."""
    return CommandSpec(argv=(sys.executable, "-c", source))


class RealChild:
    """A real process in its own session; tree = its process group (a ``ChildPort``: no dead-man's
    switch, no checkpoint file, no memory reading)."""

    ended_by_switch = False
    switch_late_seconds: float | None = None
    checkpoint_path = ""

    def __init__(
        self,
        argv: list[str],
        on_lines: Callable[[str, list[str]], None] | None,
        on_done: Callable[[ChildExit], None] | None = None,
    ) -> None:
        self._started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, args=(on_lines,), daemon=True)
        self._reader.start()
        if on_done is not None:  # the real Supervisor calls on_done from its output thread
            threading.Thread(target=lambda: on_done(self._exit(None)), daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, on_lines: Callable[[str, list[str]], None] | None) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if on_lines:
                on_lines("stdout", [line.rstrip("\n")])
        self.proc.stdout.close()

    def memory_bytes(self) -> int | None:
        return None

    def wait(self, timeout: float | None) -> ChildExit | None:
        return self._exit(timeout)

    def _exit(self, timeout: float | None) -> ChildExit:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return ChildExit(code if code >= 0 else None, -code if code < 0 else None,
                         time.monotonic() - self._started)  # fmt: skip

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait_gone(self, timeout: float | None = None) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def terminate_tree(self, grace_seconds: float | None = None, *, since: float | None = None) -> None:
        self._signal(signal.SIGTERM)

    def kill_tree(self) -> None:
        self._signal(signal.SIGKILL)


class FakeSupervisor:
    """Spawns the spec's command for real (``python_spec``: Python source run by ``sys.executable``)."""

    def __init__(self) -> None:
        self.children: dict[str, RealChild] = {}

    def start(
        self,
        task: Task,
        spec: CommandSpec,
        *,
        worker_id: str,
        on_lines: Callable[[str, list[str]], None] | None = None,
        on_done: Callable[[ChildExit], None] | None = None,
        on_started: Callable[[Any], None] | None = None,
        deadline: float | None = None,
    ) -> RealChild:
        child = RealChild(spec.command_argv(), on_lines, on_done)
        self.children[task.task_id] = child
        if on_started is not None:  # the real Supervisor calls it from its reader thread
            on_started(child)
        return child

    def close(self) -> None:
        for child in self.children.values():
            child.kill_tree()
            child.proc.wait(10)


def to_result(
    task: Task, exit_: ChildExit, spec: CommandSpec, worker_id: str, *, timed_out: bool = False
) -> TaskResult:
    if timed_out:
        return TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                          reason_for_incompletion="timed out", worker_id=worker_id)
    if exit_.exit_code == 0:
        return TaskResult(task.task_id, task.workflow_id, TaskStatus.COMPLETED, worker_id=worker_id)
    why = f"exit code {exit_.exit_code}" if exit_.exit_code is not None else f"signal {exit_.signal}"
    return TaskResult(
        task.task_id, task.workflow_id, TaskStatus.FAILED, reason_for_incompletion=why, worker_id=worker_id
    )


class Published:
    """A StatusPort keeping what each publish showed: the tasks of the latest, every server health."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tasks: list[TaskSnapshot] = []
        self.healths: list[ServerHealth] = []

    def publish(self, tasks: Sequence[TaskSnapshot], *, server: ServerHealth, paused: Sequence[str] = (),
                stopping: bool = False) -> bool:
        with self.lock:
            self.tasks = list(tasks)
            self.healths.append(server)
        return True

    def remove(self) -> None:
        pass

    def latest(self) -> ServerHealth:
        with self.lock:
            return self.healths[-1]

    def states(self) -> list[tuple[str, TaskState]]:
        with self.lock:
            return [(t.task_id, t.state) for t in self.tasks]
