"""The fleet view's scenario, for any server (embedded or real): two real runners with different
worker ids on two task types, and a third type with work queued and nobody polling it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from leasecore.fleet.view import ACTIVE_POLL_SECONDS
from tests.integration.helpers import HasUrl, World
from tests.support import wait_until


def fleet(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``conductor-run fleet ARGS`` as a separate process, without the developer's CONDUCTOR_* settings."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "fleet", *args],
        capture_output=True, text=True, timeout=60, env=base | (env or {}), cwd=cwd, check=False,
        stdin=subprocess.DEVNULL,
    )


def fleet_json(url: str, *args: str) -> dict[str, Any]:
    done = fleet("--server", url, "--json", *args)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def rows_of(doc: dict[str, Any], *task_types: str) -> dict[str, dict[str, Any]]:
    """The default-domain row of each of ``task_types``."""
    return {r["taskType"]: r for r in doc["taskTypes"] if r["taskType"] in task_types and r["domain"] is None}


def two_runners_and_a_stalled_type(tmp_path: Path, server: HasUrl) -> tuple[list[World], dict[str, Any]]:
    """Start the scenario and wait until ``fleet --json`` shows it; returns the worlds (close them)
    and the document that showed it."""
    worlds = []
    for name in ("one", "two", "stalled"):
        (tmp_path / name).mkdir()
        world = World(tmp_path / name, server)
        worlds.append(world)
        world.define(response_timeout=30)
    one, two, stalled = worlds
    one.run("--worker-id", "fleet-worker-one")
    two.run("--worker-id", "fleet-worker-two")
    stalled.start_workflow(seconds=0)
    types = (one.task_type, two.task_type, stalled.task_type)

    def shown() -> dict[str, Any] | None:
        doc = fleet_json(server.url)
        rows = rows_of(doc, *types)
        if len(rows) != 3 or rows[stalled.task_type]["queueDepth"] != 1:
            return None
        for world, worker in ((one, "fleet-worker-one"), (two, "fleet-worker-two")):
            polls = rows[world.task_type]["workers"]
            recent = bool(polls) and polls[0]["lastPollAgeSeconds"] <= ACTIVE_POLL_SECONDS
            if [w["workerId"] for w in polls] != [worker] or not recent:
                return None
        return doc

    doc = wait_until(shown, 90, "fleet --json to show both runners and the queued task", interval_seconds=0.3)
    return worlds, doc


def check_the_scenario(doc: dict[str, Any], worlds: list[World], url: str) -> None:
    one, two, stalled = worlds
    assert doc["server"] == url
    rows = rows_of(doc, one.task_type, two.task_type, stalled.task_type)
    assert rows[stalled.task_type] | {"workers": None} == {
        "taskType": stalled.task_type, "domain": None, "queueDepth": 1, "state": "stalled", "stalled": True,
        "workers": None,
    }
    assert rows[stalled.task_type]["workers"] == []
    for world in (one, two):
        row = rows[world.task_type]
        assert (row["queueDepth"], row["state"], row["stalled"]) == (0, "active", False)
        assert 0 <= row["workers"][0]["lastPollAgeSeconds"] <= ACTIVE_POLL_SECONDS
    # Stalled first: no row that is not stalled comes before a stalled one.
    states = [r["stalled"] for r in doc["taskTypes"]]
    assert states == sorted(states, reverse=True)
    assert doc["taskTypes"][0]["stalled"] is True
    # --task-type keeps only the asked types (and names one the server does not know).
    only = fleet_json(url, "--task-type", one.task_type, "--task-type", "fleet_no_such_type")
    assert {(r["taskType"], r["domain"]) for r in only["taskTypes"]} == {
        (one.task_type, None), ("fleet_no_such_type", None)
    }
    # The table off a terminal: one line per row, the stalled type before the runners' types.
    table = fleet("--server", url, "--task-type", one.task_type, "--task-type", stalled.task_type)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    stalled_line = next(i for i, line in enumerate(lines) if stalled.task_type in line)
    one_line = next(i for i, line in enumerate(lines) if one.task_type in line)
    assert stalled_line < one_line
    assert "STALLED" in lines[stalled_line] and "(no poller)" in lines[stalled_line]
    assert "fleet-worker-one" in lines[one_line] and "active" in lines[one_line]
