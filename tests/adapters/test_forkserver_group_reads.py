"""How often a tick of the fork server reads a tree's group member list: the confirming walk of a tree
that looked gone does not read again a list found empty after the first walk (a group that held no
process holds none later), and reads again one that held a process (it may have emptied since)."""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.process.forkserver import trees
from leasecore.process.forkserver.trees import Tree, attribute


def _tree(key: str, pid: int) -> Tree:
    tree = Tree(key, pid, f"token-{key}", 1.0)
    tree.cgroup = {"v": 1, "dirs": {"freezer": f"/nonexistent/{key}"}}
    tree.exited = True
    return tree


def test_a_group_found_empty_is_not_read_again_by_the_confirming_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lists = {"/nonexistent/empty": set(), "/nonexistent/held": {4242}}
    reads: list[str] = []

    def members(group: dict[str, Any]) -> set[int]:
        reads.append(group["dirs"]["freezer"])
        return set(lists[group["dirs"]["freezer"]])

    monkeypatch.setattr(trees.cgroupfs, "members", members)
    held = [_tree("empty", 101), _tree("held", 102)]
    in_groups: dict[str, set[int]] = {}

    attribute(held, {}, {"empty", "held"}, in_groups)  # the tick's first walk
    assert sorted(reads) == ["/nonexistent/empty", "/nonexistent/held"]
    assert in_groups == {"empty": set(), "held": {4242}}

    lists["/nonexistent/held"] = set()  # its member died meanwhile
    reads.clear()
    attribute(held, {}, {"empty", "held"}, in_groups)  # the confirming walk
    assert reads == ["/nonexistent/held"]  # the empty one is not read again
    assert in_groups == {"empty": set(), "held": set()}  # the fresh list is what the tick decides on


def test_without_a_list_from_this_tick_every_walked_group_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []

    def members(group: dict[str, Any]) -> set[int]:
        reads.append(group["dirs"]["freezer"])
        return set()

    monkeypatch.setattr(trees.cgroupfs, "members", members)
    held = [_tree("a", 201), _tree("b", 202)]
    attribute(held, {}, None, None)  # a signal's walk: no tick's lists
    attribute(held, {}, {"a", "b"}, {})  # a new tick: its own empty dict
    assert sorted(reads) == ["/nonexistent/a", "/nonexistent/a", "/nonexistent/b", "/nonexistent/b"]
