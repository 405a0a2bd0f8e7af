"""Simulated task trees and the fork server that holds them; each copy writes its own record.

Owns ``Copies`` (the world's record of every copy of every logical task: its start and its end, written
by the tree itself, never by a runner; the "never two live copies" check reads only these), ``SimTree``
(a leader that exits after a drawn duration, obeys or ignores TERM, takes up to ``die_within`` to die
after it, may leave setsid escapees behind; KILL ends every process within ``KILL_LATENCY_SECONDS``)
and ``SimForkServer`` (what the product's fork server does with a tree: stops what a leader left
running, TERM then KILL; kills every tree when the runner dies or when it dies itself; and, behind the
``kill_by`` switch, enforces each tree's kill-by time on its own, moved only after an acked heartbeat).

Must not: know about leases, the server or runners' state: a tree is told TERM or KILL, and says when
its leader exited and when it is gone.

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from leasecore.sim.world import World

__all__ = ["KILL_LATENCY_SECONDS", "Copies", "Copy", "SimForkServer", "SimTree"]

# KILL to the last process reaped; below the product's fence margin (0.4 s), which is meant to cover it.
KILL_LATENCY_SECONDS = 0.15


@dataclass
class Copy:
    """One copy of a logical task, as its tree records it."""

    label: str  # runner/taskId/pollCount
    task_id: str
    start: float
    end: float | None = None
    finished: bool = False  # the leader exited on its own with success (its output is real)


class Copies:
    """Every copy's record, by logical task; checks "never two live copies" as each one starts."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.by_key: dict[tuple[str, str], list[Copy]] = {}
        self.finished: set[str] = set()  # labels of copies whose leader finished on its own
        self.task_seconds = 0.0
        self.started = 0

    def start(self, key: tuple[str, str], copy: Copy) -> None:
        copies = self.by_key.setdefault(key, [])
        for other in copies:
            if other.end is None:
                self.world.violate("two live copies", f"{copy.label} started while {other.label} (since "
                                   f"{other.start - 1000.0:.3f}) still runs; logical task {key[0]}/{key[1]}")
        copies.append(copy)
        self.started += 1

    def end(self, copy: Copy) -> None:
        copy.end = self.world.now
        self.task_seconds += copy.end - copy.start


class SimTree:
    """One task's process tree: a leader and its setsid escapees."""

    def __init__(self, world: World, copies: Copies, key: tuple[str, str], copy: Copy, *, duration: float,
                 outcome: str, obeys_term: bool, die_within: float, escapees: int, escapee_life: float,
                 on_exit: Callable[[SimTree], None]) -> None:
        self.world, self.copies, self.key, self.copy = world, copies, key, copy
        self.outcome = outcome  # completed / failed / yield
        self.obeys_term, self.die_within = obeys_term, die_within
        self.escapees, self._escapee_life = escapees, escapee_life
        self.leader_alive = True
        self.signalled: str | None = None  # None: exited on its own; TERM/KILL: by that signal
        self._on_exit = on_exit
        self._termed = False
        copies.start(key, copy)
        world.log(f"tree {copy.label}: started ({outcome} in {duration:.1f} s, "
                  f"{'obeys' if obeys_term else 'ignores'} TERM, {escapees} escapee(s))")
        world.after(duration, "leader-exit", lambda: self._leader_dies(None))

    @property
    def gone(self) -> bool:
        return not self.leader_alive and self.escapees == 0

    def _leader_dies(self, signal: str | None) -> None:
        if not self.leader_alive:
            return
        self.leader_alive = False
        self.signalled = signal
        if signal is None and self.outcome == "completed":
            self.copy.finished = True
            self.copies.finished.add(self.copy.label)
        self.world.log(f"tree {self.copy.label}: leader exited ({signal or self.outcome})")
        if self.escapees and signal is None:
            # escapees left alone: each dies on its own after its life, unless stopped first
            self.world.after(self._escapee_life, "escapee-exit", self._escapees_die)
        self._maybe_gone()
        self._on_exit(self)

    def _escapees_die(self) -> None:
        if self.escapees:
            self.escapees = 0
            self._maybe_gone()

    def _maybe_gone(self) -> None:
        if self.gone and self.copy.end is None:
            self.copies.end(self.copy)
            self.world.log(f"tree {self.copy.label}: gone")

    def term(self) -> None:
        if self.gone or self._termed:
            return
        self._termed = True
        self.world.log(f"tree {self.copy.label}: TERM")
        if self.obeys_term:
            delay = self.world.rng.uniform(0.0, self.die_within)
            self.world.after(delay, "term-exit", self._die_of_term)

    def _die_of_term(self) -> None:
        self.escapees = 0
        if self.leader_alive:
            self._leader_dies("TERM")
        self._maybe_gone()

    def kill(self) -> None:
        if self.gone:
            return
        self.world.log(f"tree {self.copy.label}: KILL")
        self.world.after(self.world.rng.uniform(0.001, KILL_LATENCY_SECONDS), "kill-exit", self._die_of_kill)

    def _die_of_kill(self) -> None:
        self.escapees = 0
        if self.leader_alive:
            self._leader_dies("KILL")
        self._maybe_gone()


class SimForkServer:
    """One runner's fork server: its trees, the stopping of what a leader left, the kill-by switch."""

    def __init__(self, world: World, name: str, *, kill_by: bool) -> None:
        self.world, self.name = world, name
        self.kill_by = kill_by
        self.trees: list[SimTree] = []
        self._kill_by_at: dict[int, float] = {}  # id(tree) -> TERM time armed

    def add(self, tree: SimTree) -> None:
        self.trees = [t for t in self.trees if not t.gone]
        self.trees.append(tree)

    def leader_exited(self, tree: SimTree, grace: float) -> None:
        """The product stops what a leader left running: TERM, KILL a grace later."""
        if tree.gone:
            return
        tree.term()
        self.world.after(grace, "escapee-kill", tree.kill)

    def stop(self, tree: SimTree, at: float | None, grace: float | None) -> None:
        """TerminateTree: TERM now, KILL ``grace`` after ``at`` (the process layer's own escalation)."""
        tree.term()
        if grace is not None:
            self.world.at((at if at is not None else self.world.now) + grace, "fence-kill", tree.kill)

    def arm(self, tree: SimTree, term_at: float, grace: float) -> None:
        """Kill-by switch: the fork server TERMs at ``term_at`` and KILLs ``grace`` later on its own,
        unless a later acked heartbeat moved the time (re-armed)."""
        if not self.kill_by:
            return
        key = id(tree)
        self._kill_by_at[key] = term_at

        def enforce() -> None:
            if self._kill_by_at.get(key) == term_at and not tree.gone:
                self.world.log(f"forkserver {self.name}: kill-by passed for {tree.copy.label}")
                tree.term()
                self.world.after(grace, "killby-kill", tree.kill)

        self.world.at(term_at, "kill-by", enforce)

    def disarm(self, tree: SimTree) -> None:
        self._kill_by_at.pop(id(tree), None)

    def kill_all(self, why: str) -> list[SimTree]:
        """The runner (or this fork server) died: KILL every tree; returns them."""
        trees = [t for t in self.trees if not t.gone]
        if trees:
            self.world.log(f"forkserver {self.name}: {why}: killing {len(trees)} tree(s)")
        for tree in trees:
            tree.kill()
        self._kill_by_at.clear()
        return trees
