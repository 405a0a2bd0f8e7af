"""One lease request against the server, and what its answer means to the lease.

Owns making one of the lease engine's two calls (``runner.ports.LeasePort``: extendLease and the
ownership read) and turning its answer, or its error, into the ``Lease`` event the engine then applies
(``schedule.Answer``), and the log lines an outcome deserves: a failed heartbeat once per task per outage (its
retries at debug level: with hundreds of tasks and the server away, a line per attempt was thousands a
minute), its recovery once, a 404 and a loss of ownership when first seen. A port that raises
something unexpected is logged and counted as a failure, so no lease waits forever on a bug.

Must not touch: the lease (the engine applies the event under its lock), queues, timers, the
metrics' bookkeeping. Lines are logged under the engine's logger (``leasecore.runner.leasing.engine``), where
they have always been.

Threads: the sender that carries the request out (a ``ThreadedSenders`` thread, or ``run_due``'s
caller with ``InlineSenders``); no state of its own.
"""

from __future__ import annotations

import logging

from leasecore.errors import ConductorError, ConductorNotFound
from leasecore.lease.finalcheck import unknown_fate
from leasecore.runner.leasing.schedule import (
    Answer,
    LeaseEvent,
    beat_acked,
    beat_failed,
    beat_not_found,
    check_failed,
    ownership_read,
)
from leasecore.runner.ports import LeasePort

__all__ = ["Answer", "LeaseEvent", "extend_lease", "log_outcome", "read_ownership"]

log = logging.getLogger("leasecore.runner.leasing.engine")

def extend_lease(port: LeasePort, task_id: str, workflow_id: str, *, timeout_seconds: float,
                 sent_at: float) -> Answer:  # fmt: skip
    """Send one heartbeat (sent at ``sent_at``, monotonic seconds) and weigh its answer."""
    try:
        port.extend_lease(task_id, workflow_id, timeout_seconds=timeout_seconds)
    except ConductorNotFound:
        log.warning("task %s: the server no longer knows it (404 on a heartbeat)", task_id)
        return beat_not_found()
    except ConductorError as exc:
        return beat_failed(unknown_fate=unknown_fate(exc.status_code), error=str(exc))
    except Exception:  # a bug in the port must not leave the lease waiting forever
        log.exception("task %s: heartbeat raised unexpectedly", task_id)
        return beat_failed(unknown_fate=True)
    return beat_acked(sent_at)


def read_ownership(port: LeasePort, task_id: str, *, timeout_seconds: float) -> Answer:
    """Read the task back and weigh the answer (no answer: the check failed, the next one follows)."""
    try:
        ownership = port.get_task_ownership(task_id, timeout_seconds=timeout_seconds)
    except ConductorError as exc:
        log.warning("task %s: ownership check failed: %s", task_id, exc)
    except Exception:
        log.exception("task %s: ownership check raised unexpectedly", task_id)
    else:
        return ownership_read(ownership)
    return check_failed()


def log_outcome(
    task_id: str,
    *,
    failed_before: int,
    failed_now: int,
    beat_error: str | None = None,
    lost_before: str | None = None,
    lost_now: str | None = None,
) -> None:
    """The log lines for one applied answer: the lease's failed beats and loss reason before and after."""
    if beat_error is not None:
        level = logging.WARNING if failed_before == 0 else logging.DEBUG  # once per task per outage
        log.log(level, "task %s: heartbeat failed: %s (retrying until the lease deadline)", task_id,
                beat_error)  # fmt: skip
    elif failed_before and not failed_now:
        log.info("task %s: heartbeat acknowledged again after %d failed", task_id, failed_before)
    if lost_now is not None and lost_before is None:
        log.warning("task %s: no longer ours: %s", task_id, lost_now)
