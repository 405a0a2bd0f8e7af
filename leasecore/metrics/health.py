"""``/healthz`` and ``/readyz`` decided from a few facts about the runner (pure; no clock of its own).

Liveness (``/healthz``): the process is doing its job, or getting ready to; a probe that fails it
restarts the process, so it fails only for what a restart cures: the runner's main loop has not
turned for ``LOOP_STALL_SECONDS`` (it wakes at least twice a second), a poller or the lease engine's
timer thread is dead while the runner serves, or the runner has ended.

Readiness (``/readyz``): the worker can take work right now: the fork server is up, the Conductor
server answered within the last poll window, and the runner is not stopping. A runner with nothing
to say to the server (every task type paused, no task in flight) has no answer to wait for: that
condition is then waived. A paused task type does not make the runner unready (it still serves
the others, and a resume needs no restart): the reason names the paused types. Each refusal has a
one-line reason (the probe's body and the log).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

LOOP_STALL_SECONDS = 30.0


class RunPhase(StrEnum):
    STARTING = "starting"  # checking the server, sweeping leftovers, delivering saved results
    SERVING = "serving"
    STOPPING = "stopping"  # a stop was asked for: polling has ended, tasks are fenced or drained
    STOPPED = "stopped"


@dataclass(frozen=True)
class HealthFacts:
    """What the probes look at, read at one moment (seconds are ages: now minus the event)."""

    phase: RunPhase
    loop_age_seconds: float | None = None  # since the main loop last turned (None: not running yet)
    dead_threads: tuple[str, ...] = ()  # threads that should run and do not (pollers, lease timer)
    forkserver_up: bool = True
    contact_age_seconds: float | None = None  # since the server last answered (None: never)
    poll_window_seconds: float = 15.0  # an answer older than this means the server is away
    talking: bool = True  # something should be talking to the server (a type polled, a task in flight)
    paused: tuple[str, ...] = ()  # task types paused now: ready all the same, and the reason says so


def liveness(facts: HealthFacts) -> tuple[bool, str]:
    """(alive, one-line reason)."""
    if facts.phase is RunPhase.STOPPED:
        return False, "the runner has stopped"
    if facts.phase is RunPhase.STARTING:
        return True, "starting"
    if facts.loop_age_seconds is not None and facts.loop_age_seconds > LOOP_STALL_SECONDS:
        return False, f"the runner's main loop has not turned for {facts.loop_age_seconds:.0f} s"
    if facts.dead_threads:
        return False, "dead: " + ", ".join(facts.dead_threads)
    return True, facts.phase.value


def readiness(facts: HealthFacts) -> tuple[bool, str]:
    """(ready, one-line reason)."""
    alive, why = liveness(facts)
    if not alive:
        return False, why
    if facts.phase is RunPhase.STARTING:
        return False, "starting: not polling yet"
    if facts.phase is RunPhase.STOPPING:
        return False, "stopping: no new work is taken"
    if not facts.forkserver_up:
        return False, "the fork server is down (a new one starts with the next task)"
    if facts.talking:
        if facts.contact_age_seconds is None:
            return False, "no answer from the Conductor server yet"
        if facts.contact_age_seconds > facts.poll_window_seconds:
            return False, (f"no answer from the Conductor server for {facts.contact_age_seconds:.0f} s "
                           f"(poll window {facts.poll_window_seconds:g} s)")
    if facts.paused:
        return True, f"ready; paused: {', '.join(facts.paused)}"
    return True, "ready"
