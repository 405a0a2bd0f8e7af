"""``conductor-run demo``: the whole idea in three short scenes on the embedded server.

The scenes are played by ``leasecore.demo.scenes`` (real server, real runner process, real children) and
judged by ``leasecore.demo.judge``; this module only renders: a rich live view on a terminal, plain
timestamped lines otherwise (or with ``--plain``). Exit 0 only if every scene showed what it claims,
so the demo doubles as a smoke test.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from cli import exitcodes
from leasecore.errors import ConductorRunError, ConfigError

if TYPE_CHECKING:  # rich and the demo modules are imported when the demo runs, not at registration
    from rich.console import Console, RenderableType
    from rich.text import Text

    from leasecore.demo.judge import Event, SceneTracker, Verdict
    from leasecore.demo.plan import DemoSettings, Scene
    from leasecore.demo.scenes import DemoFiles

LIVE_EVENTS = 12  # events shown under the live table
_STYLES = {"good": "green", "warn": "yellow", "bad": "bold red", "info": ""}


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command to ``app``."""
    app.command("demo")(demo)


def demo(
    plain: bool = typer.Option(False, "--plain", help="Plain lines instead of the live view."),
    keep_files: bool = typer.Option(
        False, "--keep-files", help="Keep each scene's config, runner log and state files; print where."
    ),
) -> None:
    """Show heartbeats, a masked secret, a server timeout and a fenced kill on the embedded server (~20 s)."""
    from rich.console import Console

    from leasecore.demo.plan import DemoSettings, standard_scenes
    from leasecore.demo.scenes import DemoFiles  # heavy imports only when the command runs

    out = Console(highlight=False)
    live = out.is_terminal and not plain
    settings = DemoSettings()
    scenes = standard_scenes(settings, completed_exit=exitcodes.OK, fenced_exit=exitcodes.TASK_FAILED)
    try:
        files = DemoFiles.locate()
    except ConfigError as exc:
        typer.echo(f"conductor-run demo: {exc}", err=True)
        raise typer.Exit(exitcodes.CONFIG) from None

    work_dir = Path(tempfile.mkdtemp(prefix="conductor-run-demo-"))
    emit = _live_printer(out) if live else _plain_printer()
    emit(intro(settings, files.task_script))
    verdicts: list[Verdict] = []
    try:
        for scene in scenes:
            verdicts.append(_play(scene, settings, files, work_dir, out, live))
    except KeyboardInterrupt:
        typer.echo("conductor-run demo: interrupted", err=True)
        raise typer.Exit(exitcodes.SIGINT) from None
    except ConductorRunError as exc:
        typer.echo(f"conductor-run demo: could not set the scene up: {exc}", err=True)
        raise typer.Exit(exitcodes.UNEXPECTED) from None
    finally:
        if keep_files:
            typer.echo(f"scene files kept in {work_dir}", err=True)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)

    emit(closing(verdicts))
    if not all(v.ok for v in verdicts):
        failed = ", ".join(v.scene.title.split(".")[0] for v in verdicts if not v.ok)
        typer.echo(f"conductor-run demo: scene {failed} did not show what it claims (see above)", err=True)
        raise typer.Exit(exitcodes.UNEXPECTED)


def _play(
    scene: Scene, settings: DemoSettings, files: DemoFiles, work_dir: Path, out: Console, live: bool
) -> Verdict:
    from rich.live import Live

    from leasecore.demo.scenes import play_scene

    if not live:
        _echo(f"\n== {scene.title}\n   {scene.claim}")
        outcome = play_scene(
            scene, settings, files, work_dir=work_dir, on_event=lambda e: _echo(event_line(e))
        )
    else:
        current: list[SceneTracker] = []

        def on_sample(tracker: SceneTracker) -> None:
            current[:] = [tracker]

        with Live(
            console=out,
            refresh_per_second=8,
            transient=True,
            get_renderable=lambda: live_view(scene, current[0] if current else None),
        ):
            outcome = play_scene(
                scene, settings, files, work_dir=work_dir, on_event=lambda e: None, on_sample=on_sample
            )
        out.print(scene_record(outcome.tracker))
    verdict = outcome.verdict
    if live:
        out.print(render_verdict(verdict))
    else:
        _echo(plain_verdict(verdict))
    if outcome.leftovers_killed:
        _echo(f"   ! the demo itself had to kill {outcome.leftovers_killed} leftover process(es)")
    if not verdict.ok and outcome.runner_log_tail:
        _echo("   the runner's last log lines:")
        for line in outcome.runner_log_tail:
            _echo(f"     | {line}")
    return verdict


def _echo(text: str) -> None:
    typer.echo(text)
    sys.stdout.flush()


def _plain_printer() -> Callable[[str], None]:
    return _echo


def _live_printer(out: Console) -> Callable[[str], None]:
    return lambda text: out.print(text, markup=False)


# ---------------------------------------------------------------------------------------- pure text


def intro(settings: DemoSettings, task_script: Path) -> str:
    r = settings.response_timeout_seconds
    return (
        "conductor-run demo: three scenes, each with a fresh embedded Conductor server on 127.0.0.1, the\n"
        f"real `conductor-run run --once` as a child process and the task {_shown(task_script)}\n"
        f"(its task def sets responseTimeoutSeconds R = {r}s; the sample task runs much longer).\n"
        "Times are seconds since the scene's runner started."
    )


def _shown(path: Path) -> str:
    """The task script as the user can find it: relative to the current directory when under it
    (a source checkout: sample_tasks/demo_long.py), else the whole path (an installed wheel's copy)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def closing(verdicts: list[Verdict]) -> str:
    passed = sum(v.ok for v in verdicts)
    if passed == len(verdicts):
        return (
            f"\nAll {passed} scenes showed what they claim. Next: `conductor-run init` writes a starter\n"
            "conductor.toml; `conductor-run server` runs the embedded server for your own trials."
        )
    return f"\n{passed} of {len(verdicts)} scenes showed what they claim."


def event_line(event: Event) -> str:
    mark = {"good": "+", "warn": "!", "bad": "X"}.get(event.kind, " ")
    return f"  {mark} {event.at:5.1f}s  {event.text}"


def plain_verdict(verdict: Verdict) -> str:
    lines = [f"   {'PASS' if verdict.ok else 'FAIL'}: {verdict.summary}"]
    lines += [f"     [{'ok' if c.ok else 'FAILED'}] {c.text}" for c in verdict.checks]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- rich views


def live_view(scene: Scene, tracker: SceneTracker | None) -> RenderableType:
    """The live panel of a scene: where everything stands now, and the latest events."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    obs = tracker.latest if tracker is not None else None
    if tracker is None or obs is None:
        table.add_row("", "starting the embedded server and the runner...")
    else:
        r = tracker.r
        server = f"task {obs.task_status or '(not scheduled yet)'}, pollCount {obs.poll_count}"
        server += f", heartbeats seen {len(tracker.heartbeats)}"
        if obs.task_status == "IN_PROGRESS" and obs.updated_at is not None:
            left = obs.updated_at + r - obs.at
            server += f", times the task out in {max(left, 0.0):.1f}s unless it hears from the runner"
        table.add_row("elapsed", f"{obs.at:.1f}s")
        table.add_row("server", Text(server))
        runner = "exited" if obs.runner_exit is not None else (obs.runner_state or "polling")
        if obs.runner_exit is not None:
            runner += f" (code {obs.runner_exit})"
        if obs.lease_deadline_at is not None and obs.runner_exit is None:
            runner += f", lease deadline in {obs.lease_deadline_at - obs.at:.1f}s"
        if obs.fence_reason:
            runner += f", fenced: {obs.fence_reason}"
        table.add_row("runner", Text(runner))
        tree = "not started"
        if obs.tree:
            tree = f"pids {', '.join(map(str, obs.tree))}: {obs.tree_alive} alive"
            if obs.last_output:
                tree += f"; last output: {obs.last_output}"
        table.add_row("task tree", Text(tree))
        table.add_row(
            "connection", Text("SILENT (nothing gets through)", style="bold yellow") if obs.silent else "open"
        )
    events = tracker.events[-LIVE_EVENTS:] if tracker is not None else []
    body = Group(
        Text(scene.claim, style="italic"), Text(""), table, Text(""), *[_event_text(e) for e in events]
    )
    return Panel(body, title=scene.title, title_align="left")


def scene_record(tracker: SceneTracker) -> RenderableType:
    """What stays on screen after the live view: the scene's whole timeline."""
    from rich.console import Group
    from rich.text import Text

    lines = [Text(tracker.scene.title, style="bold"), Text(f"  {tracker.scene.claim}", style="italic")]
    lines += [_event_text(e) for e in tracker.events]
    return Group(*lines)


def render_verdict(verdict: Verdict) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    head = Text(f"  {'PASS' if verdict.ok else 'FAIL'}: ", style="bold green" if verdict.ok else "bold red")
    head.append(verdict.summary)
    checks = [
        Text(f"    {'✓' if c.ok else '✗'} {c.text}", style="green" if c.ok else "red") for c in verdict.checks
    ]
    return Group(head, *checks, Text(""))


def _event_text(event: Event) -> Text:
    from rich.text import Text

    return Text(event_line(event), style=_STYLES.get(event.kind, ""))
