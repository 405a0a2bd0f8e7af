"""What a reload may change in a running runner, and what only a restart may: pure.

Owns: :func:`reload_changes`, the comparison of the configuration a runner runs with and the one a
reload just loaded (same flags, same environment, the file read again): one line per changed value,
and one refusal per value that only a restart can change (:data:`RESTART_ONLY`, derived from the keys'
declarations: ``restart=`` on a settings field says why), each naming the key and where its new value
came from. A reload with any refusal changes nothing.

Everything not listed in :data:`RESTART_ONLY` is live: per task type, every key (concurrency,
paused, limits, exit-code policies, timeouts, command...) takes effect for the tasks started after
the reload, because the runner builds that type's plan again from the new settings; for the runner,
``log_format``/``log_level``, ``drain``/``drain_timeout`` and, while metrics stay on,
``metrics_host``/``metrics_port``.
A key added later is live unless its declaration says ``restart=``; a server key is never live.

Must not: read files, build plans or touch the runner (``leasecore.runner.wiring`` does). Pure.
Threads: any.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from leasecore.config.keys import RESTART_ONLY
from leasecore.config.settings import DEFAULT, ResolvedConfig, RunnerSettings, ServerSettings, TaskSettings

__all__ = ["RESTART_ONLY", "ReloadChanges", "reload_changes"]


@dataclass(frozen=True)
class ReloadChanges:
    """The difference between two configurations, as a reload sees it."""

    changed: tuple[str, ...] = ()  # "task t: concurrency 1 -> 2", one per changed live value
    refused: tuple[str, ...] = ()  # one per restart-only value that changed: nothing may change then
    paused: tuple[tuple[str, bool], ...] = ()  # task types whose configured ``paused`` changed, and to what

    @property
    def accepted(self) -> bool:
        return not self.refused


def reload_changes(old: ResolvedConfig, new: ResolvedConfig) -> ReloadChanges:
    """Compare the running configuration ``old`` with the reloaded ``new``; see the module docstring."""
    changed: list[str] = []
    refused: list[str] = []
    for key, _before, _after, source, _shown in _differences(old.server, new.server, ServerSettings):
        refused.append(_refusal("[server]", key, "server", source))
    for key, before, after, source, shown in _differences(old.runner, new.runner, RunnerSettings):
        if key in RESTART_ONLY["runner"]:
            refused.append(_refusal("[worker]", key, "runner", source))
        elif key == "metrics_port" and (before is None) != (after is None):
            what = "on" if after is not None else "off"
            refused.append(f"[worker] metrics_port (from {source}): turning metrics {what} needs a restart "
                           "(the runner's parts are wired to its metrics at start)")
        else:
            changed.append(f"[worker] {key}: {_show(before, shown)} -> {_show(after, shown)}")
    old_tasks = {t.type: t for t in old.tasks}
    new_tasks = {t.type: t for t in new.tasks}
    if list(old_tasks) != list(new_tasks):
        gone = [t for t in old_tasks if t not in new_tasks]
        added = [t for t in new_tasks if t not in old_tasks]
        what = "; ".join(filter(None, (f"removed {', '.join(gone)}" if gone else "",
                                       f"added {', '.join(added)}" if added else "")))
        refused.append("[[task]] type: the task types served can only change with a restart "
                       f"({what or 'reordered'})")
    paused: list[tuple[str, bool]] = []
    for name, before_task in old_tasks.items():
        after_task = new_tasks.get(name)
        if after_task is None:
            continue
        for key, before, after, source, shown in _differences(before_task, after_task, TaskSettings):
            if key in RESTART_ONLY["task"]:
                refused.append(_refusal(f"task {name}:", key, "task", source))
                continue
            if key == "paused":
                paused.append((name, bool(after)))
            changed.append(f"task {name}: {key}: {_show(before, shown)} -> {_show(after, shown)}")
    return ReloadChanges(tuple(changed), tuple(refused), tuple(paused))


def _refusal(where: str, key: str, scope: str, source: object) -> str:
    why = RESTART_ONLY[scope].get(key, "it is read once, at start")
    return f"{where} {key} (from {source}) can only change with a restart: {why}"


def _differences(old: Any, new: Any, cls: type) -> list[tuple[str, Any, Any, object, bool]]:
    """(key, before, after, the new value's source, whether values may be shown) per changed field."""
    found = []
    for item in fields(cls):
        if item.name in ("sources", "type"):
            continue
        before, after = getattr(old, item.name), getattr(new, item.name)
        if before != after:
            source = new.sources.get(item.name) or old.sources.get(item.name) or DEFAULT
            found.append((item.name, before, after, source, item.repr))  # repr=False: may be a credential
    return found


def _show(value: Any, shown: bool) -> str:
    if not shown:
        return "(not shown)"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "none" if value is None else str(value)
