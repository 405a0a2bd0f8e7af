"""What the runner tells an operator's metrics: plain method calls at the existing event points.

``Observer`` is the interface (a protocol); ``NoMetrics`` its no-op: every hook does nothing, so with
metrics off (``NO_METRICS``, the default everywhere) an event costs one empty method call. The
Prometheus side (``leasecore.metrics.prom``) implements it, and is imported only when
``--metrics-port`` is given: prometheus-client is never loaded by a runner without metrics (idle footprint).

Who calls what (each on its own thread; an implementation must be thread-safe and quick):

* ``Poller`` (its thread): ``on_poll`` after every poll request.
* ``Reporter`` (its pool): ``on_update`` after every attempt of a final update (or hand-back).
* ``LeaseEngine`` (its senders): ``on_heartbeat`` per heartbeat, ``on_ownership_check`` per check.
* ``ConductorClient`` (any thread): ``on_request`` per HTTP request, through ``request_hook``.
* ``Runner`` (its main thread only): ``on_task_held`` when it holds a polled task's command back
  (``leasecore.handover``) and when that hold ends, ``on_task_started`` when it asks for the spawn,
  ``on_task_exited`` once the command is gone (or could not start), ``on_task_done`` when the task
  leaves the runner (reported, saved for later, or no longer ours).

The label values these hooks produce are functions here (pure), so they are tested without a server:
``execute_error`` (the SDKs' ``exception`` label of ``task_execute_error_total``) and ``final_status``.
"""

from __future__ import annotations

from typing import Protocol

from leasecore.lease import FenceReason
from leasecore.models import TaskResult, TaskStatus

__all__ = [
    "NO_METRICS",
    "ExitView",
    "NoMetrics",
    "Observer",
    "error_label",
    "execute_error",
    "final_status",
]


class ExitView(Protocol):
    """What the hooks read of a command's exit (``leasecore.process.spec.ChildExit``)."""

    @property
    def exit_code(self) -> int | None: ...
    @property
    def duration_seconds(self) -> float: ...
    @property
    def start_error(self) -> str | None: ...


class Observer(Protocol):
    """The metrics hooks. ``enabled``: False when every hook does nothing (callers skip work done
    only for a hook)."""

    enabled: bool

    def on_poll(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        """One poll request ended after ``seconds`` (``error``: it raised)."""

    def on_update(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        """One attempt to send a task's result ended after ``seconds`` (``error``: it raised)."""

    def on_request(self, method: str, uri: str, status: str, seconds: float) -> None:
        """One HTTP request to the server (``uri``: the path template, ``status``: code or "error")."""

    def on_heartbeat(self, task_type: str, ok: bool, lateness_seconds: float | None) -> None:
        """One heartbeat: acknowledged or not; ``lateness_seconds`` = sent - due (None: never sent)."""

    def on_final_result_resent(self, task_type: str) -> None:
        """A final result was sent again: a late heartbeat had undone it on the server."""

    def on_ownership_check(self, task_type: str, result: str) -> None:
        """One ownership check: ``ok`` (still ours), ``lost`` (not ours any more) or ``failed``."""

    def on_task_held(self, task_type: str, held: bool, fence: FenceReason | None = None) -> None:
        """A polled task's command is held back (``held``; it occupies its slot meanwhile), or that
        hold ended (started, handed back, or fenced before it started: ``fence``, its reason)."""

    def on_task_started(self, task_type: str) -> None:
        """The runner asked for the task's command to start."""

    def on_task_exited(self, task_type: str, exit_: ExitView | BaseException | None,
                       fence: FenceReason | None, in_progress_exit_code: int | None) -> None:
        """The task's command is gone (``exit_``: a ``ChildExit``, None if lost track of, or the
        exception that kept it from starting); ``fence``: why its tree was stopped, if it was."""

    def on_switch_fenced(self, task_type: str, fence: FenceReason | None) -> None:
        """The task's tree was ended by the fork server's dead-man's switch, not by the runner: the
        runner was stalled past the lease's TERM point (``fence``: the deadline that passed)."""

    def on_result(self, task_type: str, result: TaskResult) -> None:
        """The runner hands ``result`` to the reporter (the first attempt is on its way)."""

    def on_task_done(self, task_type: str, status: TaskStatus | None, fence: FenceReason | None) -> None:
        """The task left the runner: ``status`` the server accepted (a ``TaskStatus``; None: none
        was, see ``final_status``), ``fence`` the reason its tree was stopped, if it was."""


class NoMetrics:
    """Metrics off: every hook does nothing."""

    enabled = False

    def on_poll(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        pass

    def on_update(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        pass

    def on_request(self, method: str, uri: str, status: str, seconds: float) -> None:
        pass

    def on_heartbeat(self, task_type: str, ok: bool, lateness_seconds: float | None) -> None:
        pass

    def on_final_result_resent(self, task_type: str) -> None:
        pass

    def on_ownership_check(self, task_type: str, result: str) -> None:
        pass

    def on_task_held(self, task_type: str, held: bool, fence: FenceReason | None = None) -> None:
        pass

    def on_task_started(self, task_type: str) -> None:
        pass

    def on_task_exited(self, task_type: str, exit_: ExitView | BaseException | None,
                       fence: FenceReason | None, in_progress_exit_code: int | None) -> None:
        pass

    def on_switch_fenced(self, task_type: str, fence: FenceReason | None) -> None:
        pass

    def on_result(self, task_type: str, result: TaskResult) -> None:
        pass

    def on_task_done(self, task_type: str, status: TaskStatus | None, fence: FenceReason | None) -> None:
        pass


NO_METRICS: Observer = NoMetrics()


def error_label(error: BaseException | None) -> str:
    """The SDKs' bounded ``exception`` label: the exception's class name."""
    return "None" if error is None else type(error).__name__


def execute_error(exit_: ExitView | BaseException | None, fence: FenceReason | None,
                  in_progress_exit_code: int | None) -> str | None:
    """Why a task's command counts as an execute error (None: it does not).

    A non-zero exit is this product's execute error (``NonZeroExit``), except the exit code that
    hands the task back IN_PROGRESS; a tree stopped by a fence is ``Fenced`` (its reason is in
    ``conductor_run_fences_total``); a child killed by a signal it did not get from us is
    ``KilledBySignal``; a command that never ran is the start error's class (``SpawnError``) or
    ``StartError``; a child the runner lost track of is ``LostChild``.
    """
    if isinstance(exit_, BaseException):
        return type(exit_).__name__
    if exit_ is None:
        return "LostChild"
    if exit_.start_error is not None:
        return "StartError"
    if fence is not None:
        return "Fenced"
    code = exit_.exit_code
    if code is None:
        return "KilledBySignal"
    if code == 0 or code == in_progress_exit_code:
        return None
    return "NonZeroExit"


def final_status(status: TaskStatus | None, fence: FenceReason | None) -> str:
    """The ``status`` label of ``conductor_run_task_results_total`` for a task leaving the runner:
    the status the server accepted (``TaskStatus``), ``OWNERSHIP_LOST`` (nothing reported: the task
    is someone else's) or ``UNDELIVERED`` (not accepted: kept in the outbox, or refused)."""
    if status is not None:
        return status.value
    return "OWNERSHIP_LOST" if fence is FenceReason.OWNERSHIP_LOST else "UNDELIVERED"
