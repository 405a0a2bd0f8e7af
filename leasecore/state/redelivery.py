"""What becomes of one saved result when the outbox delivers it: pure values, no file, no server.

The outbox (``leasecore.state.outbox``) asks :func:`before_send` whether a saved result may be sent at
all (not past its age limit, the task still ours), and after a failed send :func:`after_failure` turns
the final-update table's decision (``leasecore.lease.finalfailure.decide`` with ``saved``) into what
happens to the file. The outbox carries the answer out (claims, renames, unlinks, the log line); the
rules are tested as a table (``tests/unit/test_redelivery.py``).

- ``Send``: claim the file and send the result.
- ``Drop(why, bare)``: forget the file, logging ``why``; ``bare``: first send the task that status
  without the body the server refused (``finalfailure.SendBare``), once.
- ``KeepRest``: the server is unreachable or refuses our credentials: put this result back and keep
  it and every later one for the next delivery.
- ``Done``: counted delivered (a 2xx whose answer we could not read).

A failure of the read-back before a send (``sent=False``) never counts as delivered and never sends a
bare status: nothing was sent, so an unreadable answer keeps the result, and a refusal of the read
drops it as refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from leasecore.lease.finalfailure import Decision, Delivered, Save, SendBare
from leasecore.models import TaskStatus

__all__ = ["Done", "Drop", "Fate", "KeepRest", "Send", "after_failure", "before_send"]


@dataclass(frozen=True)
class Send:
    pass


@dataclass(frozen=True)
class Drop:
    why: str  # the log line's reason
    bare: TaskStatus | None = None  # first send this status without the refused body


@dataclass(frozen=True)
class KeepRest:
    pass


@dataclass(frozen=True)
class Done:
    pass


Fate = Send | Drop | KeepRest | Done


def before_send(*, age_seconds: float, max_age_seconds: float, not_ours: str | None) -> Send | Drop:
    """A saved result ``age_seconds`` old; ``not_ours``: why the task, read back, is no longer ours
    (``lease.ownership_lost_reason``; None: ours, or not read)."""
    if age_seconds > max_age_seconds:
        return Drop(f"older than {max_age_seconds:.0f} s")
    if not_ours is not None:
        return Drop(f"no longer ours: {not_ours}")
    return Send()


def after_failure(decision: Decision, *, sent: bool) -> Drop | KeepRest | Done:
    """What the final-update table's ``decision`` for a saved result means for its file. ``sent``:
    the result went out (False: the read-back before it failed)."""
    if isinstance(decision, Save) or (isinstance(decision, Delivered) and not sent):
        return KeepRest()
    if isinstance(decision, Delivered):
        return Done()
    if isinstance(decision, SendBare) and sent:
        return Drop("the server rejected it", bare=decision.status)
    return Drop("the server rejected it")
