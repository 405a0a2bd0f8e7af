"""The operator's faults: ``conductor-run pause``/``resume`` of the task type and ``drain`` of a runner,
at random moments of a seed's fault phase.

A pause stops the runner's claims (its ``PollCore``: no poll leaves, whatever the poll out brings is
handed back, no slot is kept for update-v2) for a drawn time, then a resume; its running tasks go on.
A drain stops polling for good, hands held deliveries back unstarted, lets the running trees finish
(heartbeating) until a drawn timeout, fences what is left for SHUTDOWN, and exits once every run is
reported; the runner is started again once it is down. Their invariants are checked by the runner
(``SimRunner``): no poll and no update-v2 claim leaves a paused or stopping runner; a drained runner
exits with no slot, lease, held start or next run, no poll out, and no copy started after the drain
began (from the trees' own records).

Threads: none.
"""

from __future__ import annotations

from leasecore.sim.runner import SimRunner
from leasecore.sim.world import World

__all__ = ["Operator"]

PAUSE_SECONDS = (5.0, 60.0)  # a pause lasts this long (uniform), always ending before the quiet phase
DRAIN_TIMEOUT_SECONDS = (10.0, 120.0)
HELD_LOOK_SECONDS = 5.0  # how often the operator looks for a runner holding a delivery ...
HELD_DRAIN_CHANCE = 0.25  # ... and drains it, with this chance


class Operator:
    """Pauses and drains, one every ``every`` seconds on average, until ``end``."""

    def __init__(self, world: World, runners: list[SimRunner], end: float) -> None:
        self.world, self.runners, self.end = world, runners, end
        self.every = world.rng.uniform(60.0, 240.0)
        self.count = 0

    def begin(self) -> None:
        self.world.log(f"operator: a pause or a drain every {self.every:.0f} s on average")
        self._next()
        self.world.after(HELD_LOOK_SECONDS, "operator", self._drain_a_holder)

    def _drain_a_holder(self) -> None:
        """Now and then a drain comes while a delivery is held (waiting for its previous holder): the
        moment the hand-back rule is for, too brief to be hit often by chance."""
        world, rng = self.world, self.world.rng
        if world.now >= self.end:
            return
        holding = [x for x in self.runners if x.gate.held() and not x.down and not x.stopping]
        if holding and rng.random() < HELD_DRAIN_CHANCE and (runner := rng.choice(holding)).drain(
                rng.uniform(*DRAIN_TIMEOUT_SECONDS)):
            self.count += 1
            self._restart_when_down(runner)
        world.after(HELD_LOOK_SECONDS, "operator", self._drain_a_holder)

    def _next(self) -> None:
        self.world.after(self.world.rng.expovariate(1.0 / self.every), "operator", self._fire)

    def _fire(self) -> None:
        world, rng = self.world, self.world.rng
        if world.now >= self.end:
            return
        runner = rng.choice(self.runners)
        pause = rng.random() < 0.6
        polling = [x for x in self.runners if x.polling and not x.down]
        if pause and polling and rng.random() < 0.5:  # a poll out is what a pause must hand back
            runner = rng.choice(polling)
        holding = [x for x in self.runners if x.gate.held() and not x.down and not x.stopping]
        if not pause and holding and rng.random() < 0.5:  # a held delivery is what a drain hands back
            runner = rng.choice(holding)
        if pause:
            seconds = min(rng.uniform(*PAUSE_SECONDS), max(0.0, self.end - world.now))
            if runner.pause(seconds):
                self.count += 1
        elif runner.drain(rng.uniform(*DRAIN_TIMEOUT_SECONDS)):
            self.count += 1
            self._restart_when_down(runner)
        self._next()

    def _restart_when_down(self, runner: SimRunner) -> None:
        """Started again a few seconds after its drain has let it exit (as its supervisor would)."""

        def look() -> None:
            if runner.down:
                self.world.after(self.world.rng.uniform(1.0, 10.0), "restart", runner.restart)
            else:
                self.world.after(5.0, "drain-watch", look)

        self.world.after(5.0, "drain-watch", look)
