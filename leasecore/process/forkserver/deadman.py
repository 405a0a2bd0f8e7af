"""The dead-man's switch of one task tree, pure: when the fork server ends a tree on its own.

Owns ``Switch``: a tree's kill-by times (TERM at, KILL at; monotonic seconds, the runner's lease
arithmetic: TERM at deadline - G - M, KILL at deadline - M, DESIGN.md §4), moved only forward by the
runner's renewals (one after each acknowledged heartbeat), and the decision, at a given ``now``,
whether the tree is due its TERM or its KILL because the runner did not fence it itself. The fork
server (``switches.py``) holds one per tree and carries its verdicts out; the runner's side of the
renewals is ``leasecore.runner.killby``.

The rules:

* **Forward only, and final once it acted.** A renewal keeps the later of each time (renewals sent
  from several of the runner's threads may arrive out of order; a lease's deadline never moves back).
  A renewal that arrives after the switch has acted changes nothing: like an ack processed past the
  TERM point, it cannot revive a tree the lease has given up.
* **The runner goes first.** The TERM is due ``lag`` after the TERM point (at most a quarter of the
  grace), so a runner that is alive fences the tree itself; once the tree has had a TERM from anyone,
  the switch sends none. The KILL is due at the KILL point itself, whoever TERMed.
* **A late look goes straight to the KILL.** Seen first at or past the KILL point (a fork server
  that was stopped or starved, a thawed host), the tree gets its KILL at once and no TERM: its grace
  is over.

Must not touch: a clock (``now`` is handed in), signals, processes, I/O. Stdlib only and nothing
imported: the fork server imports it (its memory counts in the runner's footprint).
Threads: none of its own; the fork server calls it under its lock (``launch.py``).
"""

from __future__ import annotations

# The runner's own fence at the TERM point goes first by this much (at most a quarter of the grace):
# its timer is accurate to a few milliseconds when the runner runs, so a TERM from the switch means the
# runner did not act in time (stalled: stopped, deadlocked, starved). Measured in docs/runner-stalls.md.
SWITCH_LAG_SECONDS = 0.1

TERM = "term"
KILL = "kill"


class Switch:
    """One tree's kill-by times and what the switch has done; see the module docstring."""

    __slots__ = ("kill_at", "killed", "lag", "late", "term_at", "termed")

    def __init__(self, term_at: float, kill_at: float, lag_seconds: float = SWITCH_LAG_SECONDS) -> None:
        self.term_at = term_at
        self.kill_at = max(kill_at, term_at)
        self.lag = lag_seconds
        self.termed = False  # the switch sent the TERM
        self.killed = False  # the switch sent (or asked for) the KILL
        self.late = 0.0  # how long after its point the switch's latest verdict came (its own lateness)

    @property
    def acted(self) -> bool:
        """Whether the switch has sent anything (from then on it is final)."""
        return self.termed or self.killed

    def renew(self, term_at: float, kill_at: float) -> bool:
        """Move the times forward (never back); False if nothing moved (not later, or acted already)."""
        if self.acted:
            return False
        kill_at = max(kill_at, term_at)
        if term_at <= self.term_at and kill_at <= self.kill_at:
            return False
        self.term_at = max(self.term_at, term_at)
        self.kill_at = max(self.kill_at, kill_at)
        return True

    def term_due_at(self) -> float:
        """When the TERM is due: the TERM point, plus the runner's head start (a quarter of the grace
        at most, so the KILL point always follows it)."""
        return self.term_at + min(self.lag, (self.kill_at - self.term_at) / 4)

    def next_at(self, term_sent: bool) -> float | None:
        """When ``step`` next has something to do (None: never again). ``term_sent``: the tree has had
        a TERM already (from the runner, or after its leader exited)."""
        if self.killed:
            return None
        if term_sent or self.termed:
            return self.kill_at
        return self.term_due_at()

    def step(self, now: float, term_sent: bool) -> str | None:
        """What is due at ``now``: ``KILL``, ``TERM`` or None. Each is returned once."""
        if self.killed:
            return None
        if now >= self.kill_at:
            self.killed = True
            self.late = now - self.kill_at
            return KILL
        if not term_sent and not self.termed and now >= self.term_due_at():
            self.termed = True
            self.late = now - self.term_due_at()
            return TERM
        return None
