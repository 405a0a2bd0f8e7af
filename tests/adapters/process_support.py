"""Helpers shared by the process-supervision tests (real children from sample_tasks/)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest

from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_tasks"


def sample(name: str) -> tuple[str, ...]:
    """argv running one of sample_tasks/ (Python ones with this interpreter)."""
    path = str(SAMPLES / name)
    return (sys.executable, path) if name.endswith(".py") else (path,)


def make_task(input_data: Mapping[str, Any] | None = None, **fields: Any) -> Task:
    defaults: dict[str, Any] = {"task_id": "task-1", "workflow_id": "wf-1", "task_type": "demo"}
    defaults.update(fields)
    return Task(input_data=dict(input_data or {}), **defaults)


def spec(*argv: str, **fields: Any) -> CommandSpec:
    return CommandSpec(argv=tuple(argv), **fields)


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (is_running also guards against pid reuse)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_with_cmdline(cmdline: list[str]) -> list[psutil.Process]:
    """Processes (of anyone's) running exactly ``cmdline``, zombies left out: a test picks a command
    line no other test or test run uses (``sleep 3217.<random digits>``, tests.daemons) to find what
    it started, wherever it was re-parented."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        info = process.info
        if info["cmdline"] == cmdline and info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def killing_leftovers(cmdline: list[str]) -> Any:
    """An autouse fixture for a test module (assign it to a module name): after each test, kill
    whatever still runs ``cmdline``."""

    @pytest.fixture(autouse=True)
    def _no_leftovers() -> Iterator[None]:
        yield
        for process in live_with_cmdline(cmdline):
            process.kill()

    return _no_leftovers


def processes_with_marker(token: str | None = None) -> list[psutil.Process]:
    """Processes of ours carrying a CONDUCTOR_RUN_TREE marker (optionally a given token)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != os.getuid():
                continue
            value = proc.environ().get("CONDUCTOR_RUN_TREE")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if value is not None and (token is None or value == token):
            found.append(proc)
    return found


def zombies_of(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    result = []
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                result.append(child)
        except psutil.NoSuchProcess:
            continue
    return result


def running_supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    """Body of each test module's ``supervisor`` fixture: a Supervisor with a minimal environment, whose
    fork server starts every command it can on a spawner thread (``forkserver/launch.py``: on an idle host
    it would start them on its main thread, which the runner's own tests cover)."""
    sup = Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)},
                     forkserver_boot=forkserver_boot_around_spawn())  # fmt: skip
    try:
        yield sup
    finally:
        sup.close()


class Lines:
    """An on_line sink that records (stream, line) pairs, thread-safely enough for list.append."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def __call__(self, stream: str, line: str) -> None:
        self.items.append((stream, line))

    def find(self, stream: str, prefix: str) -> str | None:
        for s, line in list(self.items):
            if s == stream and line.startswith(prefix):
                return line
        return None


def forkserver_boot_around_spawn(before: str = "", after: str = "", *, threads: bool | None = True) -> str:
    """A fork server boot (``forkserver_link.FORKSERVER_BOOT``) whose command starts run ``before`` (with
    ``argv`` bound) and ``after`` (with ``argv`` and ``pid``), Python statements, around the real one: each on
    a spawner thread whatever posix_spawn's waits (libc's posix_spawn, ``spawners.spawn``) or,
    ``threads=False``, on its main thread (``os.posix_spawn``; spawner threads off, as without glibc),
    or, ``threads=None``, where the fork server itself decides (by posix_spawn's waits)."""
    from leasecore.process.supervisor.forkserver_link import FORKSERVER_BOOT

    indent = "\n    "
    patch = (
        "import os, time\n"
        "import leasecore.process.forkserver.spawners as _spawners\n"
        f"def _before(argv):{indent}{indent.join((before or 'pass').splitlines())}\n"
        f"def _after(argv, pid):{indent}{indent.join((after or 'pass').splitlines())}\n"
        "_os_spawn, _lib_spawn = os.posix_spawn, _spawners.spawn\n"
        "def _os(path, argv, *a, **k):\n"
        "    _before(argv); pid = _os_spawn(path, argv, *a, **k); _after(argv, pid); return pid\n"
        "def _lib(attributes, path, argv, *a, **k):\n"
        "    _before(argv)\n    pid = _lib_spawn(attributes, path, argv, *a, **k)\n"
        "    _after(argv, pid)\n    return pid\n"
        "os.posix_spawn, _spawners.spawn = _os, _lib\n"
        + {True: "import leasecore.process.forkserver.launch as _starts\n"
                 "_starts._THREADS_ABOVE_SECONDS = -1.0\n_starts._PROBE_EVERY = 0\n",
           False: "_spawners.usable = lambda: False\n", None: ""}[threads]
    )
    main = "from leasecore.process.forkserver.server import main\n"
    assert main in FORKSERVER_BOOT
    return FORKSERVER_BOOT.replace(main, patch + main)
