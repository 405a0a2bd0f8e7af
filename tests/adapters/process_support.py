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
    line no other test uses (``sleep 3217``) to find what it started, wherever it was re-parented."""
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
    """Body of each test module's ``supervisor`` fixture: a Supervisor with a minimal environment."""
    sup = Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)})
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
