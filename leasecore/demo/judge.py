"""The demo's judge, pure: what a played scene showed, and whether that is what it claims.

Each scene (``leasecore.demo.plan``) samples the world several times a second into an
:class:`Observation` (the server's view of the task, the runner's snapshot, which processes of the
task's tree still live, the line the child printed with a server-side secret as the task log has it);
a :class:`SceneTracker` turns the samples into a timeline of :class:`Event` s, decides when the
server goes silent (scene 3), and finally judges the scene: every claim becomes a :class:`Check`
that passed or failed, with the numbers that prove it. No clock, no I/O: times are scene seconds
carried by the observations, so the judge is tested with made-up timelines.

Threads: the demo's one thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from leasecore.demo.plan import DemoSettings, Scene, SceneKind
from leasecore.demo.secret import secret_checks

__all__ = ["Check", "Event", "Observation", "SceneTracker", "Verdict"]

# Slack on the timing claims: a loaded machine samples late, never early.
LATE_SLACK_SECONDS = 3.0
EARLY_SLACK_SECONDS = 1.0

@dataclass(frozen=True)
class Observation:
    """The world at scene time ``at`` (seconds since the scene's runner was started)."""

    at: float
    runner_pid: int | None = None
    task_status: str | None = None  # the server's task status; None before the workflow scheduled it
    workflow_status: str | None = None
    poll_count: int = 0
    updated_at: float | None = None  # the server's updateTime, in scene seconds
    reason: str | None = None  # the server's reasonForIncompletion
    runner_state: str | None = None  # from the runner's status snapshot
    lease_deadline_at: float | None = None  # the runner's lease deadline, in scene seconds
    fence_reason: str | None = None
    last_output: str | None = None
    tree: tuple[int, ...] = ()  # pids of the task's tree seen so far (child, helper)
    tree_alive: int = 0  # how many of them still live
    silent: bool = False  # the relay between runner and server holds everything back
    runner_exit: int | None = None  # the runner's exit code once it has exited
    runner_said: tuple[str, ...] = ()  # the runner's warnings logged since the previous sample
    secret_line: str | None = None  # the child's line about the secret, as the server's task log has it


@dataclass(frozen=True)
class Event:
    at: float
    text: str
    kind: str = "info"  # info | good | warn | bad


@dataclass(frozen=True)
class Check:
    ok: bool
    text: str


@dataclass(frozen=True)
class Verdict:
    scene: Scene
    checks: tuple[Check, ...]
    summary: str

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


_TERMINAL = frozenset(
    {"COMPLETED", "COMPLETED_WITH_ERRORS", "FAILED", "FAILED_WITH_TERMINAL_ERROR", "TIMED_OUT", "CANCELED",
     "SKIPPED"}
)
_WORKFLOW_TERMINAL = frozenset({"COMPLETED", "FAILED", "TIMED_OUT", "TERMINATED"})


@dataclass
class SceneTracker:
    """Folds observations into facts and events; says when to go silent, resume and stop; judges."""

    scene: Scene
    settings: DemoSettings
    latest: Observation | None = None
    polled_at: float | None = None
    heartbeats: list[float] = field(default_factory=list)  # server updateTimes moved by extendLease
    max_poll_count: int = 0
    child_seen_at: float | None = None
    tree_seen: int = 0
    tree_dead_at: float | None = None
    silenced_at: float | None = None
    resumed_at: float | None = None
    fence_seen: str | None = None
    server_terminal_at: float | None = None  # when the server's task became terminal (its endTime)
    task_status: str | None = None
    workflow_status: str | None = None
    reason: str | None = None
    runner_exit: int | None = None
    runner_exit_at: float | None = None
    secret_line: str | None = None
    secret_leaks: tuple[str, ...] | None = None  # where its value was unmasked, read at the end; None: unread
    events: list[Event] = field(default_factory=list)

    @property
    def r(self) -> float:
        return float(self.settings.response_timeout_seconds)

    # ------------------------------------------------------------------------------ folding

    def observe(self, obs: Observation, *, ended_at: float | None = None) -> list[Event]:
        """Fold one sample in; return the events it revealed (also appended to ``events``).

        ``ended_at``: the server's endTime of a terminal task, in scene seconds, when known.
        """
        prev = self.latest
        new: list[Event] = []

        def say(text: str, kind: str = "info") -> None:
            new.append(Event(obs.at, text, kind))

        if prev is None and obs.runner_pid is not None:
            say(f"runner started (pid {obs.runner_pid}); the workflow's task waits in the queue")
        self.max_poll_count = max(self.max_poll_count, obs.poll_count)
        if obs.task_status == "IN_PROGRESS" and self.polled_at is None:
            self.polled_at = obs.updated_at if obs.updated_at is not None else obs.at
            say(f"the runner polled the task (pollCount {obs.poll_count}): IN_PROGRESS, and the server "
                f"now expects a sign of life within R = {self.r:g}s")
        elif (
            prev is not None
            and prev.task_status == "IN_PROGRESS"
            and obs.task_status == "IN_PROGRESS"
            and obs.poll_count == prev.poll_count
            and obs.updated_at is not None
            and prev.updated_at is not None
            and obs.updated_at > prev.updated_at
        ):
            self.heartbeats.append(obs.updated_at)
            say(f"heartbeat {len(self.heartbeats)}: extendLease acknowledged; the server now waits until "
                f"+{obs.updated_at + self.r:.1f}s", "good")
        if obs.poll_count > 1 and (prev is None or prev.poll_count < obs.poll_count):
            say(f"the task was handed out again (pollCount {obs.poll_count})", "bad")

        if obs.tree and self.child_seen_at is None:
            self.child_seen_at = obs.at
            pids = ", ".join(str(p) for p in obs.tree)
            say(f"child started: its tree is pids {pids} (the script and a helper grandchild)")
        self.tree_seen = max(self.tree_seen, len(obs.tree))
        if obs.last_output and (prev is None or obs.last_output != prev.last_output):
            say(f"child says: {obs.last_output}")

        if obs.silent and self.silenced_at is None:
            self.silenced_at = obs.at
            last = self.last_heartbeat_at
            where = ""
            if last is not None:
                where = f"; last heartbeat at +{last:.1f}s, so the lease ends at +{last + self.r:.1f}s"
            say(f"the server goes silent: requests get no answer{where}", "warn")
        if not obs.silent and self.silenced_at is not None and self.resumed_at is None:
            self.resumed_at = obs.at
            say("the server answers again (the runner may now deliver its late report)")

        for line in obs.runner_said:
            say(f"runner log: {line}", "warn")

        if obs.secret_line is not None and self.secret_line is None:
            self.secret_line = obs.secret_line
            say(f"child says (task log): {obs.secret_line}", "good")

        if obs.fence_reason and self.fence_seen is None:
            self.fence_seen = obs.fence_reason
            say(f"the runner fences the tree: {obs.fence_reason.replace('_', ' ')}", "warn")

        if self.tree_seen and obs.tree_alive == 0 and self.tree_dead_at is None:
            self.tree_dead_at = obs.at
            say(f"the whole tree is gone ({self.tree_seen} processes)", "good")

        if obs.task_status in _TERMINAL and self.server_terminal_at is None:
            self.server_terminal_at = ended_at if ended_at is not None else obs.at
            self.task_status = obs.task_status
            self.reason = obs.reason
            kind = "good" if obs.task_status == "COMPLETED" else "warn"
            say(f"server: task {obs.task_status}" + (f" ({_short(obs.reason)})" if obs.reason else ""), kind)
        if obs.workflow_status in _WORKFLOW_TERMINAL and self.workflow_status is None:
            self.workflow_status = obs.workflow_status
            say(f"server: workflow {obs.workflow_status}")

        if obs.runner_exit is not None and self.runner_exit is None:
            self.runner_exit = obs.runner_exit
            self.runner_exit_at = obs.at
            say(f"runner exited with code {obs.runner_exit}")

        self.latest = obs
        self.events.extend(new)
        return new

    # ------------------------------------------------------------------------------ decisions

    @property
    def last_heartbeat_at(self) -> float | None:
        """Server time of the last sign of life: the newest heartbeat, else the poll."""
        return self.heartbeats[-1] if self.heartbeats else self.polled_at

    def wants_silence(self) -> bool:
        return (
            self.scene.kind is SceneKind.FENCED
            and self.silenced_at is None
            and len(self.heartbeats) >= self.scene.silence_after_heartbeats
            and self.tree_dead_at is None
        )

    def wants_resume(self) -> bool:
        """Scene 3 resumes once the tree is dead and the server has timed the task out."""
        return (
            self.silenced_at is not None
            and self.resumed_at is None
            and self.tree_dead_at is not None
            and self.server_terminal_at is not None
        )

    def finished(self) -> bool:
        """Everything the scene waits for has happened, or cannot any more: the runner exited without
        polling the task (a start-up error, said in its log)."""
        if self.runner_exit is not None and self.polled_at is None:
            return True
        tree_done = self.tree_seen > 0 and self.tree_dead_at is not None
        return (
            tree_done
            and self.runner_exit is not None
            and self.task_status is not None
            and self.workflow_status is not None
        )

    # ------------------------------------------------------------------------------ the judge

    def verdict(self, *, cut_short: bool = False) -> Verdict:
        scene = self.scene
        r = self.r
        checks: list[Check] = []

        def check(ok: bool, text: str) -> None:
            checks.append(Check(bool(ok), text))

        if cut_short:
            check(False, f"the scene did not finish within {scene.budget_seconds:g}s")
        check(self.polled_at is not None, "the runner polled the task")
        pairs = ((scene.expect_task_status, scene.expect_workflow_status), *scene.also_accept)
        accepted = " or ".join(f"{task}/{workflow}" for task, workflow in pairs)
        check(
            scene.accepts(self.task_status, self.workflow_status),
            f"the server's task/workflow status is {self.task_status or 'still open'}/"
            f"{self.workflow_status or 'still running'} (expected {accepted})",
        )
        check(self.max_poll_count <= 1, f"the task was handed out once (pollCount {self.max_poll_count})")
        check(
            self.tree_seen >= 2 and self.tree_dead_at is not None,
            f"no process of the task's tree is left ({self.tree_seen} seen, "
            f"{(self.latest.tree_alive if self.latest else 0)} alive)",
        )
        check(
            self.runner_exit == scene.expect_runner_exit,
            f"the runner exited with code {self.runner_exit} (expected {scene.expect_runner_exit})",
        )
        polled = self.polled_at
        if scene.kind is SceneKind.HEARTBEATS:
            lived = _nan(self.server_terminal_at) - _nan(polled)
            check(
                len(self.heartbeats) >= 2,
                f"{len(self.heartbeats)} heartbeats moved the server's updateTime",
            )
            check(
                lived >= 2 * r,
                f"the task stayed IN_PROGRESS for {_secs(lived)} = {lived / r:.1f} x R without timing out",
            )
            summary = (
                f"{len(self.heartbeats)} heartbeats kept a {scene.task_seconds}s task alive with R = {r:g}s: "
                f"{self.task_status or 'not finished'}"
            )
            for ok, text in secret_checks(self.secret_line, self.secret_leaks) if scene.shows_secret else ():
                check(ok, text)
        elif scene.kind is SceneKind.NO_LEASE:
            grace = self.settings.kill_grace_seconds
            dead_after = _nan(self.tree_dead_at) - _nan(polled)
            ended_after = _nan(self.server_terminal_at) - _nan(polled)
            check(not self.heartbeats, f"no heartbeat was sent ({len(self.heartbeats)} seen)")
            check(
                r - grace - EARLY_SLACK_SECONDS <= dead_after <= r + LATE_SLACK_SECONDS,
                f"the tree was gone {_secs(dead_after)} after the poll: the lease ends at R = {r:g}s "
                f"(TERM {grace:g}s before it, KILL just before it)",
            )
            self._check_killed_early(check)
            check(
                ended_after >= r - EARLY_SLACK_SECONDS,
                f"the server ended the task {_secs(ended_after)} after the poll, not before R",
            )
            by = "the server timed it out" if self.task_status == "TIMED_OUT" else "the runner's report"
            summary = (
                f"no heartbeats: the tree was gone {_secs(dead_after)} after the poll (R = {r:g}s); "
                f"{self.task_status or 'not finished'} ({by} first)"
            )
        else:
            last = self.last_heartbeat_at
            deadline = _nan(last) + r
            dead = _nan(self.tree_dead_at)
            check(
                len(self.heartbeats) >= scene.silence_after_heartbeats,
                f"{len(self.heartbeats)} heartbeats flowed before the server went silent",
            )
            check(self.silenced_at is not None, "the server went silent")
            check(
                self.silenced_at is not None and dead >= self.silenced_at,
                "the tree lived on while the lease was valid",
            )
            check(
                deadline - self.settings.kill_grace_seconds - EARLY_SLACK_SECONDS <= dead
                <= deadline + LATE_SLACK_SECONDS,
                f"the tree was gone at +{_num(dead)}s; lease deadline +{_num(deadline)}s "
                f"(last acknowledged heartbeat +{_num(last)}s + R)",
            )
            self._check_killed_early(check)
            server_at = _nan(self.server_terminal_at)
            summary = (
                f"silent server: the tree was gone at +{_num(dead)}s, the lease deadline was "
                f"+{_num(deadline)}s, the server timed the task out at +{_num(server_at)}s"
            )
        return Verdict(scene, tuple(checks), summary)

    def _check_killed_early(self, check: Callable[[bool, str], None]) -> None:
        natural_end = _nan(self.polled_at) + self.scene.task_seconds
        dead = _nan(self.tree_dead_at)
        check(
            dead < natural_end - EARLY_SLACK_SECONDS,
            f"the child was killed, not finished: gone at +{_num(dead)}s, it would have run "
            f"until +{_num(natural_end)}s",
        )


def _nan(value: float | None) -> float:
    """An unknown time as NaN: every comparison with it is False, so its check fails."""
    return math.nan if value is None else value


def _num(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "?"
    return f"{value:.1f}"


def _secs(value: float) -> str:
    return "?" if math.isnan(value) else f"{value:.1f}s"


def _short(text: str, limit: int = 90) -> str:
    text = text.split(" for the taskId")[0]  # the server's timeout reason repeats ids shown elsewhere
    return text if len(text) <= limit else text[: limit - 3] + "..."

