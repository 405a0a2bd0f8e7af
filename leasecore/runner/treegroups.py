"""The cgroup mechanism and the limits of a run, from its configuration (every task tree in its own cgroup).

``setup_for(config)`` detects the mechanism once (``cgroups.detect`` with the ``cgroup`` key) and
turns a forced mode that cannot work into a ``ConfigError`` naming the key and its source;
``limit_notes(config, setup)`` are the one-line warnings for limits that are per process rather
than per tree, or not enforced at all; ``log_setup`` says both once at start. ``conductor-run
config`` shows the same lines. Detection writes nothing but a probe group of its own, made and
removed under the runner's own group.

Must not: create or remove a task's group (``process.linux.cgroups`` does, per tree), read the config file.
Threads: the caller's: the wiring at start, ``plan_for`` while it builds the plans, ``config``.
"""

from __future__ import annotations

import logging

from leasecore.config.settings import ResolvedConfig, TaskSettings
from leasecore.errors import ConfigError
from leasecore.limits import Limits
from leasecore.process.linux import cgroups

log = logging.getLogger("conductor_run.cgroups")


def limits_of(task: TaskSettings) -> Limits:
    return Limits(memory_max=task.memory_max, pids_max=task.pids_max, cpu_max=task.cpu_max,
                  nofile=task.nofile)  # fmt: skip


def setup_for(config: ResolvedConfig) -> cgroups.CgroupSetup:
    """The mechanism in force for this run (detected now: call it once)."""
    mode = config.runner.cgroup
    try:
        return cgroups.detect(mode)
    except ValueError as exc:
        source = str(config.runner.sources.get("cgroup", "default"))
        raise ConfigError(f"cgroup = {mode} (from {source}): {exc}", key="cgroup", source=source) from None


def limit_notes(config: ResolvedConfig, setup: cgroups.CgroupSetup) -> list[str]:
    """``task type T: memory_max (from SOURCE) is a per-process rlimit ...``, one line per limit."""
    notes = []
    for task in config.tasks:
        for key, note in cgroups.unenforced(limits_of(task), setup):
            source = task.sources.get(key, "default")
            notes.append(f"task type {task.type}: {key} (from {source}) {note}")
    return notes


def log_setup(config: ResolvedConfig, setup: cgroups.CgroupSetup) -> None:
    log.info("task trees: %s", setup.describe())
    for note in limit_notes(config, setup):
        log.warning("%s", note)
