"""The review's #17 holes, as pure rules: a yield waits for its tree (YieldHold), the spawn request
carries the capped kill grace (runner._spawn_spec)."""

from __future__ import annotations

from leasecore.handover import YieldHold
from leasecore.lease import LeasePolicy
from leasecore.models import TaskResult, TaskStatus
from leasecore.process.spec import CommandSpec
from leasecore.runner import _spawn_spec


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
