"""How the fork server carries out each tree's dead-man's switch (``deadman.Switch``).

Owns ``Switches``, handed the fork server's tree table (``trees.TreeTable``): arming a tree's switch
from its spawn request (``kill_by``: [TERM at, KILL at], monotonic seconds, the same clock in every
process on Linux), the ``kill_by`` renewals the runner sends after each acknowledged heartbeat (one that
arrives while the tree's start is on a spawner thread waits for it, as a signal does), the timer of the
next switch point (a heap, lazily cleaned, bounded), and, in every turn of the loop once the requests
waiting are read (their renewals applied: one read late is still true, the server extended the lease),
the TERMs and KILLs that have come due because the runner did not fence the tree itself; a spawn fires
them before it starts. So a fork server that was stopped or starved, or a host that was frozen, ends the
trees past their deadline before it starts anything new, and never one whose runner kept renewing.

A tree the switch signalled before the runner did (and before its leader exited) is *switched*: its
``exited`` event says so, and the runner reports that the lease ran out while it was stalled. A TERM
the runner asks for afterwards is not sent again (the tree has had its TERM, its KILL is due no later
than the lease allows); a runner's signal sent no later than the switch's TERM point shows the runner
was not stalled (its request waited in the socket while this process was late): not switched.

Must not touch: anything of the fork server without its lock held; how a tree is signalled (it asks in
the table's ``pending``; ``kills.Killer.flush`` signals). Stdlib only, like every module the fork server
imports. Threads: the fork server's main one and its spawners, under its lock.
"""

from __future__ import annotations

import _thread
import heapq
import os
import signal
from collections.abc import Callable
from typing import Any

from leasecore.process.forkserver.deadman import KILL, TERM, Switch
from leasecore.process.forkserver.trees import Tree, TreeTable

_EARLY_KILL_BY_MAX = 1024  # renewals kept for starts still on a spawner thread (one per start)
# The fork server's main thread (the one that fires the switches) runs at this nice value where it may
# (root, CAP_SYS_NICE): on a busy host the switch then acts on time (docs/runner-stalls.md, measured).
FORKSERVER_NICE = -10


def raise_priority(nice: int = FORKSERVER_NICE) -> int:
    """Give the calling thread ``nice`` where allowed, with SCHED_RESET_ON_FORK so that every process
    and thread it creates (the task trees, the spawner threads) starts at nice 0 again: the trees never
    inherit the boost. Returns the nice value in force (unchanged where not allowed)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= nice:
        return before
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:  # not allowed (no CAP_SYS_NICE): as it was
        return before
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    except (AttributeError, OSError):  # the trees would inherit the boost: none then
        os.setpriority(os.PRIO_PROCESS, 0, before)
    return os.getpriority(os.PRIO_PROCESS, 0)


def _times(value: Any) -> tuple[float, float] | None:
    """A ``kill_by`` field as (TERM at, KILL at), or None if absent or malformed (then: no switch)."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None
    term, kill = value
    if not all(isinstance(t, int | float) and t == t for t in (term, kill)):  # (t == t: not NaN)
        return None
    return float(term), float(kill)


class Switches:
    """The trees' dead-man's switches, carried out; see the module docstring."""

    def __init__(self, table: TreeTable, wake: Callable[[], None], main_thread: int) -> None:
        self._table = table
        self._wake = wake  # wakes the loop (from a spawner thread: it may sleep with no timeout)
        self._main_thread = main_thread
        self._wakes_at: float | None = None  # when the loop's select ends by itself (None: it waits on)
        self._heap: list[tuple[float, str]] = []  # (when, tree key); stale entries are skipped
        self._early_kill_by: dict[str, tuple[float, float]] = {}
        self._terms = self._kills = 0  # sent by a switch (``stats``)
        self._terms_withheld = 0  # a runner's TERM not sent again after the switch's (``stats``)

    def arm(self, tree: Tree, req: dict[str, Any]) -> None:
        """At spawn: the tree's switch, from the request (and a renewal that came meanwhile)."""
        times = _times(req.get("kill_by"))
        early = self._early_kill_by.pop(tree.key, None)
        if times is None:
            times = early
        elif early is not None:
            times = (max(times[0], early[0]), max(times[1], early[1]))
        if times is not None:
            tree.switch = Switch(*times)
            self._schedule(tree)
            if _thread.get_ident() != self._main_thread:  # the loop may sleep past this switch: wake it
                when = tree.switch.next_at(tree.term_sent)
                if when is not None and (self._wakes_at is None or when < self._wakes_at):
                    self._wake()  # (not when it wakes before the switch anyway: then it sees it)

    def forget(self, key: str) -> None:
        """A start on a spawner thread is over: a renewal kept for it was applied, or is moot."""
        self._early_kill_by.pop(key, None)

    def renew(self, req: dict[str, Any]) -> None:
        """A ``kill_by`` request: ``trees``, each [key, TERM at, KILL at], the leases extended by
        acknowledged heartbeats (the latest times of each, several trees in one request)."""
        trees = req.get("trees")
        for entry in trees if isinstance(trees, list) else ():
            if isinstance(entry, list) and len(entry) == 3:
                self._renew(str(entry[0]), _times(entry[1:]))

    def _renew(self, key: str, times: tuple[float, float] | None) -> None:
        if times is None:
            return
        tree = self._table.trees.get(key)
        if tree is None:
            room = key in self._early_kill_by or len(self._early_kill_by) < _EARLY_KILL_BY_MAX
            if key in self._table.inflight and room:
                old = self._early_kill_by.get(key, times)
                self._early_kill_by[key] = (max(old[0], times[0]), max(old[1], times[1]))
            return  # (else: the tree is gone, or its start failed: moot)
        if tree.switch is None:
            tree.switch = Switch(*times)
        elif not tree.switch.renew(*times):
            return
        self._schedule(tree)

    def runner_signalled(self, tree: Tree, sig: int, at: Any) -> bool:
        """The runner asks ``sig`` for ``tree`` (sent at ``at``, its monotonic clock); False: not
        sent again (the switch TERMed it already and this is a TERM)."""
        switch = tree.switch
        if switch is None or not switch.acted:
            return True
        if tree.switched and isinstance(at, int | float) and at <= switch.term_due_at():
            tree.switched = False  # the runner decided in time; this process was late to read it
        if sig == signal.SIGKILL:
            return True
        self._terms_withheld += 1
        return False

    def _schedule(self, tree: Tree) -> None:
        assert tree.switch is not None
        when = tree.switch.next_at(tree.term_sent)
        if when is None:
            return
        heapq.heappush(self._heap, (when, tree.key))
        trees = self._table.trees
        if len(self._heap) > 4 * len(trees) + 64:  # renewals leave stale entries: rebuild
            heap = [(self._due(key), key) for key in trees]
            self._heap = [(due, key) for due, key in heap if due is not None]
            heapq.heapify(self._heap)

    def _due(self, key: str) -> float | None:
        tree = self._table.trees.get(key)
        if tree is None or tree.switch is None:
            return None
        return tree.switch.next_at(tree.term_sent)

    def _next_at(self) -> float | None:
        """When the earliest switch comes due (stale heap entries are dropped here)."""
        heap = self._heap
        while heap:
            when, key = heap[0]
            due = self._due(key)
            if due is not None and due <= when:
                return due
            heapq.heappop(heap)
            if due is not None:  # moved (renewed, or TERMed by the runner: now its KILL point)
                heapq.heappush(heap, (due, key))
        return None

    def fire(self, now: float) -> bool:
        """Ask the signal of every tree whose switch is due at ``now`` (in the table's ``pending``);
        True if any was: the caller flushes them before anything else in this turn."""
        fired = False
        while (when := self._next_at()) is not None and when <= now:
            _, key = heapq.heappop(self._heap)
            tree = self._table.trees[key]
            assert tree.switch is not None
            before = tree.switch.late
            verdict = tree.switch.step(now, tree.term_sent)
            if verdict == KILL and tree.kill_sent:  # its tick KILLed it at the KILL point already
                tree.switch.late = before
            if verdict is None:  # (not due after all: back in the heap if it has a later point)
                later = tree.switch.next_at(tree.term_sent)
                if later is not None and later > now:
                    heapq.heappush(self._heap, (later, key))
                continue
            if not tree.exited and not tree.term_sent and not tree.kill_sent:
                tree.switched = True  # the runner has not fenced it: it is stalled
            if verdict == TERM:
                self._terms += 1
                tree.kill_at = tree.switch.kill_at if tree.kill_at is None else min(tree.kill_at,
                                                                                    tree.switch.kill_at)
                self._table.ask(key, signal.SIGTERM)
                self._schedule(tree)
            elif verdict == KILL:
                self._kills += 1
                tree.kill_at = now
                self._table.pending[key] = signal.SIGKILL
            fired = True
        return fired

    def timeout(self, now: float, timeout: float | None) -> float | None:
        """The loop's select timeout, shortened to the next switch point."""
        when = self._next_at()
        if when is not None:
            left = max(0.0, when - now)
            timeout = left if timeout is None else min(timeout, left)
        self._wakes_at = None if timeout is None else now + timeout
        return timeout

    def stats(self) -> dict[str, int]:
        return {"switch_terms": self._terms, "switch_kills": self._kills,
                "switch_terms_withheld": self._terms_withheld,
                "nice": os.getpriority(os.PRIO_PROCESS, 0)}  # fmt: skip
