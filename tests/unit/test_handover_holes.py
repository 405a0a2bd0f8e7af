"""The holes a review found in the no-two-copies rules, as pure rules: a yield waits for its tree
(YieldHold), the spawn request carries the capped kill grace (runner._spawn_spec)."""

from __future__ import annotations

import dataclasses

from leasecore.handover import YieldHold
from leasecore.lease import FenceReason, LeasePolicy, TerminateTree
from leasecore.models import TaskResult, TaskStatus
from leasecore.process.spec import CommandSpec
from leasecore.runner.loop.task_start import _spawn_spec


def result() -> TaskResult:
    return TaskResult("t1", "wf", TaskStatus.IN_PROGRESS, callback_after_seconds=0)


def test_a_yield_goes_out_only_once_its_tree_is_gone_or_at_its_bound() -> None:
    alive = {"tree"}
    hold = YieldHold(lambda handle: handle not in alive)
    hold.hold("t1", "tree", result(), until=10.0)
    assert hold and "t1" in hold
    assert hold.due(5.0) == []  # the tree lives: nothing goes out
    alive.clear()
    assert hold.due(5.1) == [("t1", result(), True)]  # gone: out, to be marked
    assert not hold

    alive.add("tree2")
    hold.hold("t2", "tree2", result(), until=10.0)
    assert hold.due(9.9) == []
    assert hold.due(10.0) == [("t2", result(), False)]  # still alive at its bound: out, unmarked


def test_the_spawn_request_carries_the_capped_kill_grace() -> None:
    spec = CommandSpec(argv=("true",), kill_grace_seconds=30.0)
    policy = LeasePolicy(response_timeout_seconds=8.0, kill_grace_seconds=30.0)
    assert policy.kill_grace_capped
    assert _spawn_spec(spec, policy).kill_grace_seconds == policy.effective_kill_grace_seconds < 30.0
    roomy = LeasePolicy(response_timeout_seconds=600.0, kill_grace_seconds=30.0)
    assert _spawn_spec(spec, roomy) is spec  # not capped: unchanged
    assert _spawn_spec(spec, None) is spec
    # every task of the type gets the one capped spec, equal to a replace of its own
    capped = _spawn_spec(spec, policy)
    assert _spawn_spec(spec, policy) is capped
    assert capped == dataclasses.replace(spec, kill_grace_seconds=policy.effective_kill_grace_seconds)
    other = CommandSpec(argv=("false",), kill_grace_seconds=30.0)  # another type's: its own
    assert _spawn_spec(other, policy).argv == ("false",)


def test_a_command_held_for_a_dying_tree_counts_its_exec_timeout_from_its_start() -> None:
    from tests.unit.test_lease import T0, Harness, policy

    h = Harness(policy(r=100.0, exec_timeout_seconds=30.0))  # no start delay: held for a dying tree
    h.lease.on_start_held(h.now)
    h.at(40)  # past poll + 30: not fenced, its command has not started
    assert h.fences() == []
    h.lease.on_child_started(h.now)
    h.at(80)
    assert h.fences()[0] == (T0 + 70, TerminateTree(FenceReason.EXEC_TIMEOUT))
