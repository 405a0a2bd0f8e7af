"""leasecore.handover: the yield marker and the trees of earlier attempts still dying here (pure)."""

from __future__ import annotations

from leasecore.handover import YIELD_MARKER, DyingTrees, follows_our_yield, logical_key, mark_yield
from leasecore.models import Task, TaskResult, TaskStatus


def task(task_id: str = "t1", poll_count: int = 1, ref: str = "step", output: object = None) -> Task:
    raw: dict[str, object] = {"outputData": output} if output is not None else {}
    return Task(task_id, "wf1", "x", reference_name=ref, poll_count=poll_count, raw=raw)


def test_a_yield_carries_the_poll_count_it_ends_and_the_next_delivery_follows_it() -> None:
    result = TaskResult("t1", "wf1", TaskStatus.IN_PROGRESS, {"exitCode": 75}, callback_after_seconds=5)
    marked = mark_yield(result, 3)
    assert marked.output_data == {"exitCode": 75, YIELD_MARKER: 3}
    assert follows_our_yield(task(poll_count=4, output=dict(marked.output_data)))
    assert not follows_our_yield(task(poll_count=5, output=dict(marked.output_data)))  # re-queued since


def test_only_an_in_progress_update_is_marked() -> None:
    done = TaskResult("t1", "wf1", TaskStatus.COMPLETED, {"exitCode": 0})
    assert mark_yield(done, 3) is done
    assert mark_yield(TaskResult("t1", "wf1", TaskStatus.IN_PROGRESS), 0).output_data == {}  # unknown


def test_a_marker_that_is_not_an_integer_is_not_ours() -> None:
    assert not follows_our_yield(task(poll_count=2, output={YIELD_MARKER: True}))
    assert not follows_our_yield(task(poll_count=2, output="not an object"))


def test_dying_trees_are_kept_per_logical_task_until_gone() -> None:
    gone: set[str] = set()
    trees = DyingTrees(lambda handle: handle in gone)
    trees.add(task("t1"), "tree-1")
    trees.add(task("t9", ref="other"), "tree-9")
    gone.add("gone-already")
    trees.add(task("t8"), "gone-already")  # gone by the time it is added: not kept
    # A retry (new task id, same workflow and reference name) waits; another step does not
    assert trees.still_dying(task("t2"))
    assert not trees.still_dying(task("t3", ref="third"))
    assert len(trees) == 2
    gone.add("tree-1")
    assert not trees.still_dying(task("t2"))
    trees.prune()
    assert len(trees) == 1  # only tree-9 is left
    assert logical_key(Task("t", "", "x")) is None  # unknown workflow: never matched


def test_dying_trees_stay_bounded() -> None:
    gone: set[str] = set()
    trees = DyingTrees(lambda handle: handle in gone)
    for n in range(1000):
        trees.add(task(f"t{n}", ref=f"step{n}"), f"tree-{n}")
        gone.add(f"tree-{n}")  # each dies right after
    assert len(trees) <= 257
