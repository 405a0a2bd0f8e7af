"""Rich renderables for ``conductor-run status``: pure functions of snapshot records and ``now``.

Nothing here reads files, clocks or the environment, and nothing prints: the command builds one
console and prints what these functions return. Styling lives only here. Text that came from a
snapshot (task output, ids, error messages) is always wrapped in ``Text``, never parsed as markup,
and its control characters are replaced, so a child cannot restyle or scramble the operator's
terminal.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, JustifyMethod, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from leasecore.snapshot import (
    LeaseHealth,
    RunnerSnapshot,
    ServerHealth,
    TaskSnapshot,
    TaskState,
    lease_health,
)
from leasecore.state.statefile import SnapshotRecord, find_tasks

__all__ = [
    "HEALTH_STYLES",
    "format_duration",
    "format_relative",
    "render_status",
    "render_task",
    "render_view",
]

HEALTH_STYLES: dict[LeaseHealth, str] = {
    LeaseHealth.HEALTHY: "green",
    LeaseHealth.AT_RISK: "yellow",
    LeaseHealth.FENCING: "bold red",
    LeaseHealth.STALE: "red",
    LeaseHealth.NO_LEASE: "dim",
}
_HEALTH_LABELS: dict[LeaseHealth, str] = {
    LeaseHealth.HEALTHY: "healthy",
    LeaseHealth.AT_RISK: "at risk",
    LeaseHealth.FENCING: "fencing",
    LeaseHealth.STALE: "stale",
    LeaseHealth.NO_LEASE: "-",
}
_STATE_STYLES: dict[TaskState, str] = {
    TaskState.WAITING: "dim",
    TaskState.RUNNING: "",
    TaskState.TERMINATING: "bold red",
    TaskState.REPORTING: "cyan",
    TaskState.UNDELIVERED: "yellow",
}
_SHORT_ID = 8
_TYPE_MIN = 8  # the narrowest a shortened TYPE gets: "encode_…"
_OUTPUT_MIN = len("LAST OUTPUT")  # narrower, LAST OUTPUT is left out instead
_MAX_LISTED = 10  # task ids named in an ambiguous-prefix message


def format_duration(seconds: float) -> str:
    """A compact magnitude: ``3.2s``, ``2m05s``, ``1h02m``, ``3d04h`` (the sign is dropped)."""
    s = abs(seconds)
    if s < 60:
        return f"{s:.1f}s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def format_bytes(size: int | None) -> str:
    """``48.2M`` / ``1.5G`` (powers of 1024); ``-`` when unknown."""
    if size is None:
        return "-"
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{size}B"


def format_relative(moment: datetime | None, now: datetime) -> str:
    """``3.2s ago``, ``in 1.1s``, ``now``, or ``-`` when there is no such moment."""
    if moment is None:
        return "-"
    delta = (moment - now).total_seconds()
    if abs(delta) < 0.05:
        return "now"
    return f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(delta)} ago"


def _clean(text: str) -> str:
    return "".join(c if c.isprintable() else (" " if c == "\t" else "\ufffd") for c in text)


def _short(identifier: str) -> str:
    return identifier if len(identifier) <= _SHORT_ID else identifier[:_SHORT_ID]


def _task_labels(records: Sequence[SnapshotRecord]) -> dict[str, str]:
    """Each task id as the table shows it: the shortest prefix, at least 8 long, that ``status`` finds.

    A prefix that another task's id starts with would be ambiguous (or find that other task, when it
    is that id), so it is lengthened until none does; an id that is a prefix of another stays whole,
    which ``find_tasks`` resolves as an exact match. The same id in two runners shares one label.
    """
    return prefix_labels({t.task_id for r in records if r.snapshot for t in r.snapshot.tasks})


def prefix_labels(ids: set[str], shortest: int = _SHORT_ID) -> dict[str, str]:
    """Each id's shortest prefix (at least ``shortest`` long) that no other id starts with, else the
    whole id. In sorted order the ids sharing a prefix are neighbours, so only the longest common
    prefix with each neighbour counts: O(n log n), for a live view redrawn with 1000 tasks."""
    ordered = sorted(ids)
    labels: dict[str, str] = {}
    for i, task_id in enumerate(ordered):
        neighbours = [ordered[j] for j in (i - 1, i + 1) if 0 <= j < len(ordered)]
        # Character by character is what is wanted here: these are ids, not paths.
        common = (len(os.path.commonprefix((task_id, other))) for other in neighbours)  # noqa: RUF071
        shared = max(common, default=0)
        labels[task_id] = task_id[: max(shortest, shared + 1)]
    return labels


def _server_text(server: ServerHealth, now: datetime) -> Text:
    if server.consecutive_failures:
        text = Text(f"server unreachable: {server.consecutive_failures} failed calls", style="yellow")
        if server.backoff_seconds > 0:
            text.append(f", retry in {format_duration(server.backoff_seconds)}")
        if server.last_ok_at is not None:
            text.append(f", last ok {format_relative(server.last_ok_at, now)}")
        return text
    if server.last_ok_at is None:
        return Text("server not contacted yet", style="dim")
    return Text(f"server ok, last call {format_relative(server.last_ok_at, now)}", style="green")


def _runner_header(record: SnapshotRecord, now: datetime) -> Text:
    snap = record.snapshot
    if snap is None:
        reasons = dict.fromkeys(r for r in (record.stale_reason, record.error) if r)  # once each
        return Text(_clean(f"{record.path.name}: {'; '.join(reasons)}"), style="red")
    header = Text()
    header.append(f"runner {record.pid}", style="bold")
    if record.stale_reason is not None:
        header.append(_clean(f"  STALE ({record.stale_reason})"), style="bold red")
    header.append(_clean(f"  worker {snap.runner.worker_id}  server {snap.runner.server_url}"))
    if record.stale_reason is None:
        header.append(f"  up {format_duration((now - snap.runner.started_at).total_seconds())}  ")
        header.append_text(_server_text(snap.server, now))
        if snap.stopping:
            header.append("  STOPPING (not polling)", style="bold yellow")
        if snap.paused:
            header.append(_clean(f"  PAUSED: {', '.join(snap.paused)}"), style="bold yellow")
    else:
        ran = format_duration((snap.updated_at - snap.runner.started_at).total_seconds())
        header.append(f"  ran {ran}  ")
        header.append(f"last update {format_relative(snap.updated_at, now)}", style="red")
    if snap.runner.cgroup:  # which cgroup mechanism holds its trees, and why not a better one
        header.append("\n")
        header.append(_clean(f"  task trees: {snap.runner.cgroup}"), style="dim")
    return header


_GAP = 2  # cells are padded one space on each side, so two columns are two spaces apart


@dataclass(eq=False)
class _Column:
    """One column of the tasks table, with every cell, so that its full width is known."""

    header: str
    cells: list[Text] = field(default_factory=list)
    justify: JustifyMethod = "left"
    shrink_to: int | None = None  # free text: may end in "…" at this width; others are never cut
    drop_order: int | None = None  # left out, lowest first, when the table cannot fit otherwise

    @property
    def natural(self) -> int:
        return max([cell_len(self.header), *(cell.cell_len for cell in self.cells)])

    @property
    def narrowest(self) -> int:
        return self.natural if self.shrink_to is None else min(self.natural, self.shrink_to)


def _span(widths: Sequence[int]) -> int:
    return sum(widths) + _GAP * (len(widths) - 1)


def _fit(columns: Sequence[_Column], max_width: int) -> list[tuple[_Column, int]]:
    """Which columns to show in ``max_width`` cells, and how wide.

    Everything at full width when it fits. Otherwise the free-text columns are shortened first, then
    columns are left out by ``drop_order`` until the rest fits; the room left over goes back to the
    free-text columns, leftmost first. Ids, pids, states and times are shown whole or not at all.
    """
    shown = list(columns)
    for victim in sorted((c for c in columns if c.drop_order is not None), key=lambda c: c.drop_order or 0):
        if _span([c.narrowest for c in shown]) <= max_width:
            break
        shown.remove(victim)
    widths = [c.narrowest for c in shown]
    spare = max_width - _span(widths)
    for i, column in enumerate(shown):
        grow = max(0, min(spare, column.natural - widths[i]))
        widths[i] += grow
        spare -= grow
    return list(zip(shown, widths, strict=True))


class _TasksTable:
    """The tasks table, laid out for the width it is drawn in (a terminal's, or ``status``'s own)."""

    def __init__(self, columns: Sequence[_Column], rows: int) -> None:
        self.columns = list(columns)
        self.rows = rows

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        everything = _span([c.natural for c in self.columns])
        return Measurement(_span([width for _, width in _fit(self.columns, 0)]), everything)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        fitted = _fit(self.columns, options.max_width)
        table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
        for column, width in fitted:
            table.add_column(
                column.header, justify=column.justify, width=width, no_wrap=True, overflow="ellipsis"
            )
        for row in range(self.rows):
            table.add_row(*(column.cells[row] for column, _ in fitted))
        # When even the columns never left out are wider than the terminal, draw them whole anyway:
        # the console then crops the line at its edge instead of rich cutting every cell.
        width = max(options.max_width, _span([width for _, width in fitted]))
        yield from console.render(table, options.update_width(width))


def _tasks_table(snap: RunnerSnapshot, stale: bool, now: datetime, labels: dict[str, str]) -> _TasksTable:
    # Left out on a narrow terminal in the order of drop_order; TASK, PID, STATE and LEASE always stay.
    type_ = _Column("TYPE", shrink_to=_TYPE_MIN, drop_order=7)
    task_id = _Column("TASK")
    workflow = _Column("WORKFLOW", drop_order=4)
    pid = _Column("PID")
    state = _Column("STATE")
    lease = _Column("LEASE")
    elapsed = _Column("ELAPSED", drop_order=6)
    last_beat = _Column("LAST BEAT", justify="right", drop_order=3)
    next_beat = _Column("NEXT BEAT", justify="right", drop_order=2)
    lease_ends = _Column("LEASE ENDS", justify="right", drop_order=5)
    hard_limit = _Column("HARD LIMIT", justify="right", drop_order=1)
    output = _Column("LAST OUTPUT", shrink_to=_OUTPUT_MIN, drop_order=0)
    memory = _Column("MEMORY", justify="right", drop_order=-1)  # the first left out
    progress = _Column("PROGRESS", justify="right", drop_order=-1)  # (only when a task gives one)
    tasks = sorted(snap.tasks, key=lambda t: t.started_at)
    for task in tasks:
        health = lease_health(task, now, runner_stale=stale)
        style = HEALTH_STYLES[health]
        type_.cells.append(Text(_clean(task.task_type)))
        task_id.cells.append(Text(_clean(labels[task.task_id])))
        workflow.cells.append(Text(_short(_clean(task.workflow_id))))
        pid.cells.append(Text("-" if task.child_pid is None else str(task.child_pid)))
        state.cells.append(Text(str(task.state), style=_STATE_STYLES[task.state]))
        switched = " (switch)" if task.fenced_by == "switch" else ""  # ended by the fork server's switch
        lease.cells.append(Text(_HEALTH_LABELS[health] + switched, style=style))
        elapsed.cells.append(Text(format_duration((now - task.started_at).total_seconds())))
        last_beat.cells.append(Text(format_relative(task.last_ack_at, now)))
        next_beat.cells.append(Text(format_relative(task.next_heartbeat_at, now)))
        lease_ends.cells.append(Text(format_relative(task.lease_deadline_at, now), style=style))
        hard_limit.cells.append(Text(format_relative(task.hard_deadline_at, now)))
        output.cells.append(Text(_clean(task.last_output_line or ""), style="dim"))
        memory.cells.append(Text(format_bytes(task.memory_bytes)))
        progress.cells.append(Text(format_progress(task.progress)))
    columns: tuple[_Column, ...] = (
        type_,
        task_id,
        workflow,
        pid,
        state,
        lease,
        elapsed,
        last_beat,
        next_beat,
        lease_ends,
        hard_limit,
        memory,
        output,
    )
    if any(task.progress is not None for task in tasks):
        columns = (*columns[:6], progress, *columns[6:])
    return _TasksTable(columns, len(tasks))


def format_progress(progress: float | None) -> str:
    """A checkpoint's progress as a whole percentage ("-": none given)."""
    return "-" if progress is None else f"{progress * 100:.0f}%"


def _runner_block(record: SnapshotRecord, now: datetime, labels: dict[str, str]) -> RenderableType:
    parts: list[RenderableType] = [_runner_header(record, now)]
    snap = record.snapshot
    if snap is not None:
        if snap.tasks:
            parts.append(_tasks_table(snap, record.is_stale, now, labels))
        else:
            parts.append(Text("  no tasks in flight", style="dim"))
    return Group(*parts)


def render_status(
    records: Sequence[SnapshotRecord], now: datetime, *, state_dir: Path | None = None
) -> RenderableType:
    """Every runner on the host with its tasks; one clear line when there is none."""
    if not records:
        where = f" (state directory {state_dir})" if state_dir is not None else ""
        return Text(_clean(f"No conductor-run runners on this host{where}."))
    labels = _task_labels(records)
    blocks: list[RenderableType] = []
    for i, record in enumerate(records):
        if i:
            blocks.append(Text(""))
        blocks.append(_runner_block(record, now, labels))
    return Group(*blocks)


def _moment(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    clock = moment.astimezone(UTC).strftime("%H:%M:%S UTC")
    return f"{format_relative(moment, now)} ({clock})"


def render_task(record: SnapshotRecord, task: TaskSnapshot, now: datetime) -> RenderableType:
    """One task in full, with its recent output lines."""
    health = lease_health(task, now, runner_stale=record.is_stale)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    runner = f"{record.pid}"
    if record.snapshot is not None:
        runner += f" (worker {record.snapshot.runner.worker_id})"
    rows: list[tuple[str, Text]] = [
        ("task", Text(_clean(task.task_id))),
        ("workflow", Text(_clean(task.workflow_id))),
        ("type", Text(_clean(task.task_type))),
        ("runner", Text(_clean(runner))),
        ("child pid", Text("-" if task.child_pid is None else str(task.child_pid))),
        ("state", Text(str(task.state), style=_STATE_STYLES[task.state])),
        ("lease", Text(_HEALTH_LABELS[health], style=HEALTH_STYLES[health])),
        ("started", Text(_moment(task.started_at, now))),
        ("last heartbeat", Text(_moment(task.last_ack_at, now))),
        ("next heartbeat", Text(_moment(task.next_heartbeat_at, now))),
        ("lease ends", Text(_moment(task.lease_deadline_at, now), style=HEALTH_STYLES[health])),
        ("hard limit", Text(_moment(task.hard_deadline_at, now))),
        ("failed beats", Text(str(task.consecutive_failures))),
        ("memory", Text(format_bytes(task.memory_bytes))),
    ]
    if task.progress is not None:
        rows.append(("progress", Text(format_progress(task.progress))))
    if record.stale_reason is not None:
        rows.insert(4, ("runner state", Text(_clean(f"STALE ({record.stale_reason})"), style="bold red")))
    if task.fence_reason is not None:
        rows.append(("fence reason", Text(_clean(task.fence_reason), style="red")))
    if task.fenced_by == "switch":  # not the runner: its fork server, alone (docs/runner-stalls.md)
        rows.append(("fenced by", Text("the fork server's dead-man's switch (the runner was stalled)",
                                       style="bold red")))  # fmt: skip
    elif task.fenced_by is not None:
        rows.append(("fenced by", Text(_clean(task.fenced_by))))
    for key, value in rows:
        grid.add_row(key, value)
    output: list[RenderableType] = [Text(f"recent output ({len(task.recent_output)} lines):", style="bold")]
    output.extend(Text("  " + _clean(line), no_wrap=True, overflow="ellipsis") for line in task.recent_output)
    if not task.recent_output:
        output.append(Text("  (none yet)", style="dim"))
    return Group(grid, Text(""), *output)


def render_view(
    records: Sequence[SnapshotRecord],
    now: datetime,
    *,
    task_id: str | None = None,
    state_dir: Path | None = None,
) -> RenderableType:
    """What ``status`` shows: every runner, or the one task ``task_id`` (a unique prefix will do)."""
    if task_id is None:
        return render_status(records, now, state_dir=state_dir)
    matches = find_tasks(records, task_id)
    if not matches:
        return Text(_clean(f"No task {task_id} on this host."))
    if len(matches) > 1:
        listed = sorted(t.task_id for _, t in matches)
        ids = ", ".join(listed[:_MAX_LISTED])
        if len(listed) > _MAX_LISTED:
            ids += f" and {len(listed) - _MAX_LISTED} more"
        message = f"Task id prefix {task_id} is ambiguous ({len(listed)} tasks): {ids}"
        return Text(_clean(message), style="yellow")
    record, task = matches[0]
    return render_task(record, task, now)
