"""Plays the demo's scenes for real: embedded server, silenceable relay, a real runner process.

For each scene (``leasecore.demo.plan``) a fresh :class:`~leasecore.server.EmbeddedServer` gets the
sample definitions (``sample_tasks/demo_taskdefs.json``, ``demo_workflow.json``) and one workflow; a
:class:`~leasecore.demo.proxy.SilenceProxy` sits between it and the runner, which is the real
``conductor-run run --once`` in a child process, configured by a generated ``conductor.toml``. The
scene is sampled every ``sample_interval`` seconds: the server's view of the task (read directly, not
through the relay), the runner's status snapshot, and which pids of the task's tree still live (the
sample task writes them to a file). The tracker turns samples into events and a verdict; the caller
renders them. Whatever happens, nothing outlives a scene: the runner is stopped and any leftover
process of the task's tree is killed (and the verdict then says so).

Must not touch: the product's modules beyond their public API (it drives a real runner process,
as a user would). Threads: the demo's own thread, plus the embedded server's and the relay's.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w

from leasecore.clock import Clock, SystemClock
from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.demo.judge import Event, Observation, SceneTracker, Verdict
from leasecore.demo.plan import DemoSettings, Scene, runner_config, task_defs_for
from leasecore.demo.proxy import SilenceProxy
from leasecore.demo.secret import SECRET_NAME, leaks, secret_line
from leasecore.errors import ConductorError, ConfigError
from leasecore.server import EmbeddedServer
from leasecore.snapshot import TaskSnapshot
from leasecore.state.statefile import ProcessState, probe_process, process_start_ticks, read_snapshots

__all__ = ["DemoFiles", "SceneOutcome", "play_scene", "sample_dirs"]

_STOP_WAIT_SECONDS = 10.0  # after the scene: how long the runner gets to exit after SIGTERM
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class DemoFiles:
    """The sample files the demo runs: the task script and the definitions."""

    task_script: Path
    workflow: Path
    task_defs: Path

    @classmethod
    def locate(cls, directory: Path | None = None) -> DemoFiles:
        """The sample files in ``directory`` if one is given; else those shipped in the package
        (``leasecore/sample_tasks/`` of an installed wheel), else ``sample_tasks/`` of the source
        checkout beside the package (an editable install). ConfigError naming what is missing."""
        problems = []
        for base in [directory] if directory is not None else sample_dirs():
            files = cls(base / "demo_long.py", base / "demo_workflow.json", base / "demo_taskdefs.json")
            paths = (files.task_script, files.workflow, files.task_defs)
            missing = [path.name for path in paths if not path.is_file()]
            if not missing:
                return files
            problems.append(f"{', '.join(missing)} in {base}")
        raise ConfigError(
            f"the demo needs {' or '.join(problems)}: reinstall conductor-run (its package ships them),"
            " or run it from a source checkout (git clone, then pip install -e .)",
            key="sample_tasks",
        )

    def definitions(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            workflow = json.loads(self.workflow.read_text(encoding="utf-8"))
            task_defs = json.loads(self.task_defs.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            msg = f"cannot read the demo's sample definitions: {exc}"
            raise ConfigError(msg, key="sample_tasks") from exc
        if not isinstance(workflow, dict) or not isinstance(task_defs, list):
            raise ConfigError("the demo's sample definitions have the wrong shape", key="sample_tasks")
        return workflow, task_defs


def sample_dirs() -> list[Path]:
    """Where the sample files may be, in lookup order: inside the installed package (a wheel maps
    the repository's ``sample_tasks/`` onto ``leasecore/sample_tasks/``, see pyproject.toml), then
    ``sample_tasks/`` beside the package (a source checkout or editable install). Only real
    directories: the runner runs the task script by path."""
    dirs = []
    package = importlib.resources.files("leasecore")
    if isinstance(package, Path):
        dirs.append(package / "sample_tasks")
    dirs.append(Path(__file__).resolve().parents[2] / "sample_tasks")
    return dirs


@dataclass(frozen=True)
class SceneOutcome:
    verdict: Verdict
    tracker: SceneTracker
    runner_log_tail: tuple[str, ...]  # the runner's last log lines, to explain a failed scene
    leftovers_killed: int  # processes of the task's tree the demo had to kill itself


# A warning or error of the runner's log, or the one line its CLI prints when it cannot start at all
# ("conductor-run: configuration error: ...").
_LOG_LINE = re.compile(
    r"^(?:\S+\s+(WARNING|ERROR)\s+(?:task [0-9a-fA-F-]+: )?|conductor-run(?: [a-z]+)?: )(?P<text>.*)$"
)


class _RunnerLog:
    """Follows the runner's log file; hands out its new warning and error lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def new_warnings(self) -> tuple[str, ...]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return ()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        found = []
        for line in lines:
            match = _LOG_LINE.match(line)
            if match:
                found.append(match.group("text"))
        return tuple(found)


class _Tree:
    """The task's pids as the sample task records them, each with its start time (no pid reuse)."""

    def __init__(self, pids_file: Path) -> None:
        self.pids_file = pids_file
        self.pids: dict[int, int | None] = {}

    def refresh(self) -> None:
        try:
            text = self.pids_file.read_text(encoding="utf-8")
        except OSError:
            return
        complete = text if text.endswith("\n") else text.rpartition("\n")[0]
        for line in complete.split():
            pid = int(line)
            if pid not in self.pids:
                self.pids[pid] = process_start_ticks(pid)

    def alive(self) -> list[int]:
        return [pid for pid, ticks in self.pids.items() if probe_process(pid, ticks) is ProcessState.ALIVE]

    def kill_leftovers(self) -> int:
        left = self.alive()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return len(left)


def _child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's environment minus every Conductor setting: the scene's config file says it all."""
    prefixes = ("CONDUCTOR_", "conductor_", "conductor.")
    return {k: v for k, v in environ.items() if not k.startswith(prefixes)}


def play_scene(
    scene: Scene,
    settings: DemoSettings,
    files: DemoFiles,
    *,
    work_dir: Path,
    on_event: Callable[[Event], None],
    on_sample: Callable[[SceneTracker], None] | None = None,
    environ: Mapping[str, str] | None = None,
    clock: Clock | None = None,
    python: str = sys.executable,
    sample_interval: float = 0.1,
) -> SceneOutcome:
    """Play one scene from start to verdict; raises only ConductorRunError subclasses (setup failures)."""
    clock = clock or SystemClock()
    scene_dir = work_dir / str(scene.kind)
    scene_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state_dir = scene_dir / "state"
    pids_file = scene_dir / "tree.pids"
    log_path = scene_dir / "runner.log"
    workflow_def, task_defs = files.definitions()

    # The server holds the secret the task def declares, a fresh value per scene (never shown).
    token = secrets.token_urlsafe(18)
    server = EmbeddedServer(runtime_environ={f"CONDUCTOR_SECRET_{SECRET_NAME}": token})
    with server, SilenceProxy("127.0.0.1", server.port) as proxy:
        client = ConductorClient(server.url, timeout_seconds=5.0)
        try:
            admin = ConductorAdmin(client)
            admin.register_task_defs(task_defs_for(task_defs, settings))
            admin.register_workflow(workflow_def, overwrite=True)
            config = runner_config(
                scene,
                settings,
                server_url=proxy.url_for("/api"),
                command=[python, str(files.task_script)],
                worker_id=f"demo-{scene.kind}",
            )
            config_path = scene_dir / "conductor.toml"
            config_path.write_text(tomli_w.dumps(config), encoding="utf-8")
            workflow_id = admin.start_workflow(
                str(workflow_def["name"]), {"seconds": scene.task_seconds, "pids_file": str(pids_file)}
            )
            argv = [python, "-m", "cli", "run", "--once", "--config", str(config_path),
                    "--state-dir", str(state_dir)]
            with open(log_path, "w", encoding="utf-8") as log_file:
                runner = subprocess.Popen(
                    argv,
                    cwd=scene_dir,
                    env=_child_environ(os.environ if environ is None else environ),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            tracker = SceneTracker(scene, settings)
            tree = _Tree(pids_file)
            runner_log = _RunnerLog(log_path)
            leftovers = 0
            try:
                cut_short = _sample_until_done(
                    scene, tracker, admin, workflow_id, runner, tree, runner_log, proxy, state_dir, clock,
                    on_event, on_sample, sample_interval,
                )
            finally:
                proxy.resume()
                _stop(runner)
                tree.refresh()
                leftovers = tree.kill_leftovers()
            if scene.shows_secret:
                _read_for_secret(tracker, token, admin, workflow_id, log_path)
            verdict = tracker.verdict(cut_short=cut_short)
            return SceneOutcome(verdict, tracker, _tail(log_path), leftovers)
        finally:
            client.close()


def _sample_until_done(
    scene: Scene,
    tracker: SceneTracker,
    admin: ConductorAdmin,
    workflow_id: str,
    runner: subprocess.Popen[bytes],
    tree: _Tree,
    runner_log: _RunnerLog,
    proxy: SilenceProxy,
    state_dir: Path,
    clock: Clock,
    on_event: Callable[[Event], None],
    on_sample: Callable[[SceneTracker], None] | None,
    sample_interval: float,
) -> bool:
    """Sample until the scene is over; True when it had to be cut short at its budget."""
    start = clock.monotonic()
    wall_start = clock.now().timestamp()
    while True:
        at = clock.monotonic() - start
        want_secret = scene.shows_secret and tracker.secret_line is None
        obs, ended_at = _observe(
            at, wall_start, admin, workflow_id, runner, tree, proxy, state_dir, clock, want_secret
        )
        obs = replace(obs, runner_said=runner_log.new_warnings())
        for event in tracker.observe(obs, ended_at=ended_at):
            on_event(event)
        if on_sample is not None:
            on_sample(tracker)
        if tracker.wants_silence():
            proxy.silence()
        elif tracker.wants_resume():
            proxy.resume()
        if tracker.finished():
            return False
        if at > scene.budget_seconds:
            return True
        time.sleep(sample_interval)  # the sampling period of the live view


def _observe(
    at: float,
    wall_start: float,
    admin: ConductorAdmin,
    workflow_id: str,
    runner: subprocess.Popen[bytes],
    tree: _Tree,
    proxy: SilenceProxy,
    state_dir: Path,
    clock: Clock,
    want_secret: bool,
) -> tuple[Observation, float | None]:
    def scene_time(epoch_ms: Any) -> float | None:
        if not isinstance(epoch_ms, int | float) or epoch_ms <= 0:
            return None
        return float(epoch_ms) / 1000.0 - wall_start

    def scene_time_of(moment: datetime | None) -> float | None:
        return None if moment is None else moment.timestamp() - wall_start

    silent = proxy.silent
    exit_code = runner.poll()
    task: dict[str, Any] = {}
    workflow_status: str | None = None
    try:
        workflow = admin.get_workflow(workflow_id)
        workflow_status = str(workflow.get("status"))
        tasks = workflow.get("tasks") or []
        task = dict(tasks[-1]) if tasks else {}
    except ConductorError:
        pass  # the embedded server is in-process: a failed read is rare; the next sample retries
    said_secret = None
    if want_secret and task.get("taskId"):
        with contextlib.suppress(ConductorError):  # as above: the next sample reads it again
            said_secret = secret_line(admin.get_logs(str(task["taskId"])))
    tree.refresh()
    alive = tree.alive()
    snap = _runner_task(state_dir, clock.now(), str(task.get("taskId", "")))
    status = task.get("status")
    obs = Observation(
        at=at,
        runner_pid=runner.pid,
        task_status=None if status is None else str(status),
        workflow_status=workflow_status,
        poll_count=int(task.get("pollCount") or 0),
        updated_at=scene_time(task.get("updateTime")),
        reason=task.get("reasonForIncompletion"),
        runner_state=None if snap is None else str(snap.state),
        lease_deadline_at=None if snap is None else scene_time_of(snap.lease_deadline_at),
        fence_reason=None if snap is None else snap.fence_reason,
        last_output=None if snap is None else snap.last_output_line,
        tree=tuple(tree.pids),
        tree_alive=len(alive),
        silent=silent,
        runner_exit=exit_code,
        secret_line=said_secret,
    )
    return obs, scene_time(task.get("endTime"))


def _read_for_secret(
    tracker: SceneTracker, token: str, admin: ConductorAdmin, workflow_id: str, log_path: Path
) -> None:
    """Once the scene is over: where the secret's value is to be seen as it is (the task log, the
    workflow with its tasks' input and output, the runner's log), and the child's line if the
    samples missed it."""
    try:
        workflow = admin.get_workflow(workflow_id)
        task_ids = [str(task["taskId"]) for task in workflow.get("tasks") or []]
        logs = [entry for task_id in task_ids for entry in admin.get_logs(task_id)]
        runner_log = log_path.read_text(encoding="utf-8", errors="replace")
    except (ConductorError, OSError, KeyError):
        return  # secret_leaks stays None: the verdict says the places could not be read
    if tracker.secret_line is None:
        tracker.secret_line = secret_line(logs)
    places = {"the task log": json.dumps(logs), "the workflow": json.dumps(workflow),
              "the runner's log": runner_log}  # fmt: skip
    tracker.secret_leaks = leaks(token, places)


def _runner_task(state_dir: Path, now: datetime, task_id: str) -> TaskSnapshot | None:
    if not task_id:
        return None
    try:
        records = read_snapshots(state_dir, now)
    except (ConfigError, OSError):
        return None  # not created yet, or being replaced: the next sample reads it
    for record in records:
        if record.snapshot is None or record.is_stale:
            continue
        for task in record.snapshot.tasks:
            if task.task_id == task_id:
                return task
    return None


def _stop(runner: subprocess.Popen[bytes]) -> None:
    """The runner normally exited already; if not, TERM (it cleans up), then KILL."""
    if runner.poll() is not None:
        return
    runner.send_signal(signal.SIGTERM)
    try:
        runner.wait(timeout=_STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        runner.kill()
        runner.wait()


def _tail(path: Path) -> tuple[str, ...]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ()
    return tuple(lines[-_LOG_TAIL_LINES:])
