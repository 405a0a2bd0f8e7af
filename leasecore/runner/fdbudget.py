"""The runner's file-descriptor budget: how many task trees its open-file limit lets it hold at once.

The runner keeps two fds per running tree (the read ends of its stdout and stderr pipes) and a
reserve of its own (log and status files, the state record, epoll, the fork server's socket, one
connection per poller and per sender thread, the metrics and control sockets, a spawn's passing
pipes). The fork server keeps one per tree (a pidfd), so the runner's limit binds first. A spawn
past that limit fails with EMFILE after the task was claimed; so this module sizes the slots ahead:

- ``raise_soft_limit``: at start, the soft RLIMIT_NOFILE is raised as far as the configured
  concurrency needs (``fds_needed``), never past the hard limit (or ``MAX_RAISE``); the fork server
  and the children inherit it. A runner whose trees fit under its limit leaves it alone, so a
  child sees the limit it would have had without conductor-run (some programs still use
  ``select``, which breaks on an fd above 1023).
- ``trees_that_fit(limit, task_types)``: the trees that limit holds beside the reserve.
- ``share(concurrencies, fit)``: each task type's slots when their sum would not fit (max-min fair:
  no type gets more than it asked for, small types keep theirs, the rest is split evenly).
- ``fit_plans``: the plans with those slots, and the warning to log (None when all fit).
- ``out_of_fds(why)``: a start that failed for want of fds (EMFILE, ENFILE), in the runner or the fork
  server: the runner's shortage, not the task's fault, so the task is handed back (``handed_back``)
  rather than failed (``TaskEnds.report_not_started``).

Must not: print, exit, or change a limit anywhere but in ``raise_soft_limit``. Threads: the CLI's
main thread (start and reload); ``out_of_fds`` anywhere.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import resource
from collections.abc import Sequence
from typing import NamedTuple

from leasecore.errors import ConfigError
from leasecore.models import Task, TaskResult
from leasecore.runner.chain import hand_back
from leasecore.runner.ports import TaskTypePlan

FDS_PER_TREE = 2  # the runner's read ends of a tree's stdout and stderr pipes
RESERVE_FDS = 256  # the runner's own: files, epoll, sockets of 64 + 64 sender threads, a spawn's pipes
RESERVE_FDS_PER_TYPE = 2  # a poller's connection (and one being replaced)
# A task handed back for want of fds is re-queued this much later: a runner short of fds does not
# claim it straight back in a loop, and any other worker may take it then.
FD_SHORT_REQUEUE_SECONDS = 2
MAX_RAISE = 1 << 20  # Linux's default fs.nr_open: a soft limit above it is refused anyway
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE})
_EMFILE_TEXT, _ENFILE_TEXT = os.strerror(errno.EMFILE), os.strerror(errno.ENFILE)


class Raised(NamedTuple):  # (not a dataclass: one costs ~1 ms of the runner's start-up to define)
    """What ``raise_soft_limit`` did: the soft limit before and after, and the hard limit."""

    before: int
    after: int
    hard: int
    error: str | None = None  # why a raise was refused (the soft limit stays)
    asked: int = 0  # the soft limit the raise asked for (``soft_target``)


def soft_target(soft: int, hard: int, needed: int) -> int:
    """The soft limit to ask for: ``needed``, bounded by the hard limit (``RLIM_INFINITY``:
    ``MAX_RAISE``), never lower than ``soft`` is now."""
    ceiling = MAX_RAISE if hard == resource.RLIM_INFINITY or hard < 0 else min(hard, MAX_RAISE)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return soft
    return max(soft, min(needed, ceiling))


def fds_needed(concurrencies: Sequence[int]) -> int:
    """The open-file limit under which every configured slot can hold its tree at once."""
    return reserve_fds(len(concurrencies)) + FDS_PER_TREE * sum(concurrencies)


def raise_soft_limit(needed: int) -> Raised:
    """Raise this process's soft RLIMIT_NOFILE toward ``needed`` (``fds_needed``), within its hard
    limit (the fork server, started later, and its children inherit it). Refused (a container's
    seccomp, a hard limit above nr_open): the soft limit stays, the error is said."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft_target(soft, hard, needed)
    if target == soft:
        return Raised(soft, soft, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return Raised(soft, soft, hard, error=str(exc), asked=target)
    return Raised(soft, target, hard, asked=target)


def current_limit() -> int:
    """This process's soft RLIMIT_NOFILE (``MAX_RAISE`` when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_RAISE if soft == resource.RLIM_INFINITY or soft < 0 else soft


def reserve_fds(task_types: int) -> int:
    """The runner's fds that are not a tree's, with ``task_types`` pollers."""
    return RESERVE_FDS + RESERVE_FDS_PER_TYPE * task_types


def trees_that_fit(limit: int, task_types: int) -> int:
    """How many trees the runner can hold at once under an open-file limit of ``limit``."""
    return max(0, (limit - reserve_fds(task_types)) // FDS_PER_TREE)


def share(concurrencies: Sequence[int], fit: int) -> tuple[int, ...]:
    """Each task type's slots so that their sum is at most ``fit``: unchanged when it already is;
    else the largest level L with sum(min(c, L)) <= fit, then one more each (in the configured order)
    to the types above L while room is left. ValueError when ``fit`` cannot give every type one slot."""
    asked = tuple(concurrencies)
    if sum(asked) <= fit:
        return asked
    if fit < len(asked):
        raise ValueError(f"room for {fit} task trees, fewer than the {len(asked)} task types")
    low, high = 1, max(asked)  # sum(min(c, 1)) = len(asked) <= fit; sum(min(c, max)) > fit
    while high - low > 1:
        mid = (low + high) // 2
        if sum(min(c, mid) for c in asked) <= fit:
            low = mid
        else:
            high = mid
    shares = [min(c, low) for c in asked]
    left = fit - sum(shares)
    for i, c in enumerate(asked):
        if left == 0:
            break
        if c > shares[i]:
            shares[i] += 1
            left -= 1
    return tuple(shares)


def fit_plans(plans: Sequence[TaskTypePlan], limit: int) -> tuple[list[TaskTypePlan], str | None]:
    """``plans`` with their concurrency cut to what an open-file limit of ``limit`` holds, and the
    warning that says so (None: every slot fits). ConfigError (exit 3 at start, a refused reload) when
    not even one tree per task type fits."""
    asked = [plan.poll.concurrency for plan in plans]
    fit = trees_that_fit(limit, len(plans))
    try:
        shares = share(asked, fit)
    except ValueError:
        raise ConfigError(
            f"the open-file limit (RLIMIT_NOFILE) is {limit}: it leaves room for {fit} task trees at "
            f"{FDS_PER_TREE} fds each beside the {reserve_fds(len(plans))} the runner keeps, not one for "
            f"each of its {len(plans)} task types; raise it (ulimit -n, systemd LimitNOFILE=)"
        ) from None
    if list(shares) == asked:
        return list(plans), None
    each = ", ".join(f"{p.poll.task_type} {a} -> {s}" for p, a, s in zip(plans, asked, shares, strict=True))
    warning = (f"the open-file limit (RLIMIT_NOFILE) is {limit}: it holds {fit} task trees at once "
               f"({FDS_PER_TREE} fds each, {reserve_fds(len(plans))} kept for the runner), fewer than the "
               f"concurrency asked ({sum(asked)}); running at most {sum(shares)} at once ({each}); raise "
               f"the limit (ulimit -n, systemd LimitNOFILE=) to run more")  # fmt: skip
    capped = [
        dataclasses.replace(p, poll=dataclasses.replace(p.poll, concurrency=s)) if s != a else p
        for p, a, s in zip(plans, asked, shares, strict=True)
    ]
    return capped, warning


def out_of_fds(why: object) -> bool:
    """True when a start failed for lack of file descriptors, EMFILE (a process's limit) or ENFILE
    (the system's): ``why`` is the runner's exception (a ``SpawnError`` raised from the ``OSError``)
    or the fork server's answer as ``ChildExit.start_error`` ("cannot start 'x': <strerror> (while
    doing receive fds)", its strerror made by ``os.strerror``, as here)."""
    if isinstance(why, str):
        return f": {_EMFILE_TEXT} (while" in why or f": {_ENFILE_TEXT} (while" in why
    seen = why if isinstance(why, BaseException) else None
    for _ in range(4):  # a SpawnError raised from the OSError, at most a short chain
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _SHORTAGE:
            return True
        seen = seen.__cause__
    return False


def handed_back(task: Task, worker_id: str | None) -> TaskResult:
    """The update for a task whose command could not start for want of fds: nothing of it ran, so it
    goes back to the queue (``chain.hand_back``: no retry spent), ``FD_SHORT_REQUEUE_SECONDS`` later."""
    return dataclasses.replace(hand_back(task, worker_id), callback_after_seconds=FD_SHORT_REQUEUE_SECONDS)
