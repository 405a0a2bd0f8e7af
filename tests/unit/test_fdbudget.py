"""The runner's fd budget (leasecore.runner.fdbudget): how many trees an open-file limit holds, how
the task types share them when the concurrency asked is more, what a raise asks for, and which spawn
errors are a shortage of fds."""

from __future__ import annotations

import dataclasses
import errno
import resource

import pytest

from leasecore.config.settings import ResolvedConfig, RunnerSettings, ServerSettings, TaskSettings
from leasecore.errors import ConfigError, SpawnError
from leasecore.handover import follows_our_yield
from leasecore.lease import LeasePolicy
from leasecore.models import Task, TaskStatus
from leasecore.process import CommandSpec
from leasecore.runner import fdbudget
from leasecore.runner.fdbudget import (
    FDS_PER_TREE,
    out_of_fds,
    reserve_fds,
    share,
    soft_target,
    trees_that_fit,
)
from leasecore.runner.plans import Reloader
from leasecore.runner.ports import PollSettings, TaskTypePlan


def _plan(task_type: str, concurrency: int) -> TaskTypePlan:
    return TaskTypePlan(
        poll=PollSettings(task_type, concurrency=concurrency),
        spec=CommandSpec(argv=("true",)),
        worker_id="w",
        make_policy=lambda task: LeasePolicy(response_timeout_seconds=30),
    )


def test_trees_that_fit_leave_the_reserve_and_take_two_fds_each() -> None:
    assert reserve_fds(1) == 258 and reserve_fds(10) == 276
    assert trees_that_fit(20_000, 10) == (20_000 - 276) // FDS_PER_TREE == 9862
    assert trees_that_fit(1024, 1) == 383
    assert trees_that_fit(259, 1) == 0 and trees_that_fit(100, 1) == 0  # never negative


def test_share_keeps_what_fits_and_splits_fairly_what_does_not() -> None:
    assert share([4, 8], 100) == (4, 8)  # fits: unchanged
    assert share([1000] * 10, 9862) == (987, 987) + (986,) * 8  # even, the remainder in config order
    assert share([1000, 10], 500) == (490, 10)  # a small type keeps all it asked for
    assert share([5, 3, 1], 6) == (3, 2, 1)
    assert share([5, 3, 1], 3) == (1, 1, 1)
    for asked, fit in (([1000] * 10, 9862), ([7, 300, 2], 100), ([1, 1, 50], 3)):
        got = share(asked, fit)
        assert sum(got) == fit and all(1 <= g <= a for g, a in zip(got, asked, strict=True))
    with pytest.raises(ValueError, match="room for 2 task trees, fewer than the 3 task types"):
        share([5, 5, 5], 2)


def test_fit_plans_caps_the_concurrency_and_says_so_once() -> None:
    plans = [_plan("a", 1000), _plan("b", 4)]
    same, warning = fdbudget.fit_plans(plans, 20_000)
    assert same == plans and warning is None
    capped, warning = fdbudget.fit_plans(plans, 1024)  # (1024 - 260) // 2 = 382 trees
    assert [p.poll.concurrency for p in capped] == [378, 4]
    assert capped[1] is plans[1] and capped[0].spec is plans[0].spec
    assert warning is not None
    for part in (
        "RLIMIT_NOFILE) is 1024",
        "holds 382 task trees",
        "concurrency asked (1004)",
        "at most 382 at once",
        "a 1000 -> 378, b 4 -> 4",
        "ulimit -n",
    ):
        assert part in warning, warning
    with pytest.raises(ConfigError, match=r"RLIMIT_NOFILE\) is 259: it leaves room for 0 task trees"):
        fdbudget.fit_plans([_plan("a", 3)], 259)


def test_the_soft_limit_is_raised_only_as_far_as_the_concurrency_needs_never_lowered() -> None:
    inf = resource.RLIM_INFINITY
    assert soft_target(1024, 524288, 600) == 1024  # the trees fit: the child keeps the usual limit
    assert soft_target(1024, 524288, 20_258) == 20_258
    assert soft_target(1024, 4096, 20_258) == 4096  # no further than the hard limit
    assert soft_target(20_000, 20_000, 20_258) == 20_000
    assert soft_target(1024, inf, 1 << 30) == fdbudget.MAX_RAISE  # the kernel refuses more than nr_open
    assert soft_target(1024, 1 << 30, 1 << 30) == fdbudget.MAX_RAISE
    assert soft_target(inf, inf, 5000) == inf
    assert soft_target(2_000_000, inf, 5000) == 2_000_000  # already above: left alone
    assert fdbudget.fds_needed([4]) == fdbudget.RESERVE_FDS + fdbudget.RESERVE_FDS_PER_TYPE + 8
    two_types = fdbudget.RESERVE_FDS + 2 * fdbudget.RESERVE_FDS_PER_TYPE
    assert fdbudget.fds_needed([10_000, 3]) == two_types + 20_006
    # what is asked for is what fits: the raise and the cap agree
    for asked in ([1], [4, 4], [9_862], [100, 200, 3]):
        assert fdbudget.trees_that_fit(fdbudget.fds_needed(asked), len(asked)) == sum(asked)


def test_out_of_fds_reads_the_spawn_errors_cause() -> None:
    def spawn_error(cause: BaseException | None) -> SpawnError:
        try:
            raise SpawnError("cannot make the command's output pipes: Too many open files") from cause
        except SpawnError as exc:
            return exc

    assert out_of_fds(spawn_error(OSError(errno.EMFILE, "Too many open files")))
    assert out_of_fds(spawn_error(OSError(errno.ENFILE, "Too many open files in system")))
    assert out_of_fds(OSError(errno.EMFILE, "Too many open files"))
    assert not out_of_fds(spawn_error(OSError(errno.ENOSPC, "No space left on device")))
    assert not out_of_fds(spawn_error(None))  # no such command, say: the task's own fault
    assert not out_of_fds(SpawnError("command not found: nope"))
    # The fork server's answer, as ChildExit.start_error (forkserver_link.spawn_failure's words)
    assert out_of_fds("cannot start '/bin/sh': Too many open files (while doing receive fds)")
    assert out_of_fds("cannot start '/bin/sh': Too many open files in system (while doing fork)")
    assert not out_of_fds("cannot start 'x': No such file or directory (while doing exec)")
    assert not out_of_fds(None)


def test_a_task_that_could_not_start_for_want_of_fds_goes_back_unspent() -> None:
    task = Task(task_id="t1", workflow_id="wf", task_type="a", poll_count=1, raw={"outputData": {}})
    result = fdbudget.handed_back(task, "w")
    assert result.status is TaskStatus.IN_PROGRESS  # not FAILED: no retry spent, re-queued for anyone
    assert result.callback_after_seconds == fdbudget.FD_SHORT_REQUEUE_SECONDS > 0
    assert follows_our_yield(dataclasses.replace(task, poll_count=2, raw={"outputData": result.output_data}))


def _config(concurrency: int) -> ResolvedConfig:
    return ResolvedConfig(ServerSettings(), RunnerSettings(),
                          (TaskSettings("encode", command=("true",), concurrency=concurrency),))  # fmt: skip


def test_a_reload_asking_more_than_the_limit_holds_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fdbudget, "current_limit", lambda: 400)  # (400 - 258) // 2 = 71 trees
    loads = iter([_config(50), _config(200)])
    reloader = Reloader(_config(10), lambda: next(loads), None, None)
    fits = reloader()
    assert [p.poll.concurrency for p in fits.plans] == [50] and fits.warnings == ()
    cut = reloader()
    assert [p.poll.concurrency for p in cut.plans] == [71]
    assert len(cut.warnings) == 1 and "concurrency asked (200); running at most 71" in cut.warnings[0]
    monkeypatch.setattr(fdbudget, "current_limit", lambda: 200)  # not one tree: the reload is refused
    loads = iter([_config(4)])
    with pytest.raises(ConfigError, match=r"RLIMIT_NOFILE\) is 200"):
        reloader()
