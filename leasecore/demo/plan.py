"""The demo's script, pure: the scenes, what each claims, and what its runner and server are given.

``conductor-run demo`` plays three scenes against the embedded server (``leasecore.demo.scenes`` does the
I/O); each :class:`Scene` says what it shows, how long its task would run, which outcome counts and
how long it may take. ``runner_config`` and ``task_defs_for`` turn a scene into the runner's config and
the server's task definitions. Whether a played scene showed its claim is
``leasecore.demo.judge``'s. No clock, no I/O.

Threads: the demo's one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from leasecore.demo.secret import SECRET_NAME

__all__ = [
    "TASK_TYPE",
    "DemoSettings",
    "Scene",
    "SceneKind",
    "runner_config",
    "standard_scenes",
    "task_defs_for",
]

TASK_TYPE = "demo_long_job"  # the task in sample_tasks/demo_workflow.json and demo_taskdefs.json



class SceneKind(StrEnum):
    HEARTBEATS = "heartbeats"  # lease extension on: a task several times longer than R completes
    NO_LEASE = "no_lease"  # lease extension off: the lease ends at R, the tree is killed by then
    FENCED = "fenced"  # the server goes silent: the tree is dead by the lease deadline


@dataclass(frozen=True)
class DemoSettings:
    """Numbers shared by every scene."""

    response_timeout_seconds: int = 2  # R, the task def's responseTimeoutSeconds
    # Within its cap for R = 2 s (a quarter of R, and R - margin - the heartbeats' 1.25 s = 0.35 s): a
    # longer one would be cut, with a warning.
    kill_grace_seconds: float = 0.3
    ownership_check_interval_seconds: float = 1.0
    poll_timeout_ms: int = 500


@dataclass(frozen=True)
class Scene:
    kind: SceneKind
    title: str
    claim: str
    task_seconds: int  # how long the sample task would run if left alone
    expect_task_status: str
    expect_workflow_status: str
    expect_runner_exit: int
    budget_seconds: float  # the scene is cut short (and fails) after this long
    silence_after_heartbeats: int = 0  # FENCED: the server goes silent after this many heartbeats
    # Other (task status, workflow status) outcomes that are just as right (a race with no loser).
    also_accept: tuple[tuple[str, str], ...] = ()
    shows_secret: bool = False  # judge the server-side secret's way to the child, and its masking

    def accepts(self, task_status: str | None, workflow_status: str | None) -> bool:
        expected = ((self.expect_task_status, self.expect_workflow_status), *self.also_accept)
        return (task_status, workflow_status) in expected


def standard_scenes(settings: DemoSettings, *, completed_exit: int, fenced_exit: int) -> tuple[Scene, ...]:
    """The three scenes; exit codes come from the caller (they belong to the CLI)."""
    r = settings.response_timeout_seconds
    return (
        Scene(
            kind=SceneKind.HEARTBEATS,
            title="1. Heartbeats keep a long task alive",
            claim=(
                f"responseTimeoutSeconds is {r}s but the task runs {4 * r - 1}s: extendLease heartbeats "
                "keep its lease, and it completes; a secret the server holds reaches the child as "
                f"${SECRET_NAME} and in $CONDUCTOR_SECRETS_FILE, masked (***) in what the runner writes"
            ),
            task_seconds=4 * r - 1,
            expect_task_status="COMPLETED",
            expect_workflow_status="COMPLETED",
            expect_runner_exit=completed_exit,
            budget_seconds=20 + 4 * r,
            shows_secret=True,
        ),
        Scene(
            kind=SceneKind.NO_LEASE,
            title="2. The same task without heartbeats",
            claim=(
                f"with lease extension off nothing extends the lease: the child's tree is dead by R = {r}s "
                "after the poll (TERM kill_grace before it, KILL just before it), when the server may "
                "time the task out; the server records its TIMED_OUT or the runner's FAILED (lease "
                "expired), whichever lands first"
            ),
            task_seconds=6 * r,
            expect_task_status="TIMED_OUT",
            expect_workflow_status="TIMED_OUT",
            expect_runner_exit=fenced_exit,
            budget_seconds=20 + 4 * r,
            also_accept=(("FAILED", "FAILED"),),
        ),
        Scene(
            kind=SceneKind.FENCED,
            title="3. A fenced kill: the server goes silent",
            claim=(
                "heartbeats flow, then the server stops answering: the whole tree is dead by the lease "
                f"deadline (last acknowledged heartbeat + {r}s; TERM kill_grace before it, KILL just "
                "before it), so it is gone before the server can hand the task to anyone else"
            ),
            task_seconds=8 * r,
            expect_task_status="TIMED_OUT",
            expect_workflow_status="TIMED_OUT",
            expect_runner_exit=fenced_exit,
            budget_seconds=25 + 4 * r,
            silence_after_heartbeats=2,
        ),
    )


def runner_config(
    scene: Scene, settings: DemoSettings, *, server_url: str, command: Sequence[str], worker_id: str
) -> dict[str, Any]:
    """The ``conductor.toml`` content the scene's runner reads (written with tomli-w by the caller)."""
    task: dict[str, Any] = {
        "type": TASK_TYPE,
        "command": list(command),
        "worker_id": worker_id,
        "lease_extend_enabled": scene.kind is not SceneKind.NO_LEASE,
        "kill_grace": settings.kill_grace_seconds,
        "ownership_check_interval": settings.ownership_check_interval_seconds,
        "poll_timeout": settings.poll_timeout_ms,
        "poll_interval": 100,
    }
    # No heartbeat_timeout in any scene: the lease deadline is R (a longer one is capped at R anyway).
    return {"server": {"url": server_url}, "task": [task]}


def task_defs_for(task_defs: Sequence[dict[str, Any]], settings: DemoSettings) -> list[dict[str, Any]]:
    """The sample task defs with the demo's R (the file says 2 s too; this keeps them in step) and the
    demo's secret declared (``runtimeMetadata``)."""
    out = []
    for td in task_defs:
        copy = dict(td)
        if copy.get("name") == TASK_TYPE:
            copy["responseTimeoutSeconds"] = settings.response_timeout_seconds
            copy["runtimeMetadata"] = [SECRET_NAME]
        out.append(copy)
    return out
