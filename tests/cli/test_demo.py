"""``conductor-run demo``: the real command without a TTY, its failure paths, and its live view."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import exitcodes
from cli.demo import live_view, plain_verdict
from cli.main import _register, app
from leasecore.demo.judge import Observation, SceneTracker
from leasecore.demo.plan import DemoSettings, standard_scenes
from leasecore.demo.scenes import DemoFiles
from leasecore.errors import ConfigError

SETTINGS = DemoSettings()
SCENES = standard_scenes(SETTINGS, completed_exit=exitcodes.OK, fenced_exit=exitcodes.TASK_FAILED)


def _processes_using(directory: Path) -> list[str]:
    """Processes whose command line or working directory is inside ``directory``."""
    found = []
    needle = str(directory)
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            cwd = proc.info["cwd"] or ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if needle in cmdline or cwd.startswith(needle):
            found.append(f"{proc.info['pid']}: {cmdline} (cwd {cwd})")
    return found


def test_demo_without_a_tty_passes_every_scene_and_leaves_no_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    env["TMPDIR"] = str(tmp_path)  # every scene file, runner cwd and task cwd lives under tmp_path
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "demo"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    took = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert took < 90  # "under a minute" on an idle machine; generous here for a loaded one
    assert "\x1b[" not in out  # plain lines: no escape codes without a terminal

    assert out.count("PASS: ") == 3 and "FAIL: " not in out and "[FAILED]" not in out
    assert re.search(r"PASS: \d+ heartbeats kept a 7s task alive with R = 2s: COMPLETED", out)
    assert "server: task COMPLETED" in out and "server: workflow COMPLETED" in out
    assert "server: task TIMED_OUT" in out
    # Scene 2: lease extension off, so the lease ends at R: the runner fences the tree itself (the
    # server's TIMED_OUT or the runner's FAILED, whichever lands first; the verdict checks both).
    ended = r"(TIMED_OUT \(the server timed it out first\)|FAILED \(the runner's report first\))"
    gone = r"PASS: no heartbeats: the tree was gone \d+\.\ds after the poll \(R = 2s\); "
    assert re.search(gone + ended, out)
    assert "the server goes silent" in out
    assert out.count("runner log: terminating the process tree (lease expired)") == 2  # scenes 2 and 3
    assert out.count("the whole tree is gone (2 processes)") == 3
    assert "All 3 scenes showed what they claim." in out
    # Scene 1: the server's secret reached the child both ways, and the line holding its value is masked.
    said = "secret DEMO_API_TOKEN: the same in $DEMO_API_TOKEN and in $CONDUCTOR_SECRETS_FILE: ***"
    assert f"child says (task log): {said}\n" in out
    assert "[ok] the secret's value is nowhere unmasked (task log, task output, runner log)" in out

    # Every pid the demo showed (runners, children, helpers) is gone, and nothing runs in its files.
    pids = {int(p) for p in re.findall(r"runner started \(pid (\d+)\)", out)}
    for listed in re.findall(r"its tree is pids ([\d, ]+) \(", out):
        pids |= {int(p) for p in listed.split(", ")}
    assert len(pids) == 9
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert _processes_using(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # the scene files were removed


def test_missing_sample_files_is_a_clear_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"demo_long\.py, demo_workflow\.json, demo_taskdefs\.json"):
        DemoFiles.locate(tmp_path)
    real_locate = DemoFiles.locate

    def locate_nowhere(directory: Path | None = None) -> DemoFiles:
        return real_locate(tmp_path)

    monkeypatch.setattr(DemoFiles, "locate", staticmethod(locate_nowhere))
    _register()
    result = CliRunner().invoke(app, ["demo", "--plain"])
    assert result.exit_code == exitcodes.CONFIG
    assert "run it from a source checkout" in result.output
    assert "Traceback" not in result.output


def test_the_sample_definitions_are_found_and_well_formed() -> None:
    workflow, task_defs = DemoFiles.locate().definitions()
    assert [t["name"] for t in workflow["tasks"]] == ["demo_long_job"]
    assert task_defs[0]["name"] == "demo_long_job"
    assert task_defs[0]["responseTimeoutSeconds"] == SETTINGS.response_timeout_seconds


def test_live_view_shows_server_runner_tree_and_connection() -> None:
    scene = SCENES[2]
    tracker = SceneTracker(scene, SETTINGS)
    console = Console(record=True, width=120, color_system=None)
    console.print(live_view(scene, None))
    assert "starting the embedded server" in console.export_text()

    tracker.observe(Observation(at=1.1, runner_pid=7, task_status="IN_PROGRESS", poll_count=1, updated_at=1.0,
                                tree=(11, 12), tree_alive=2))
    tracker.observe(Observation(at=2.7, runner_pid=7, task_status="IN_PROGRESS", poll_count=1, updated_at=2.6,
                                runner_state="running", lease_deadline_at=4.6, tree=(11, 12), tree_alive=2,
                                last_output="working: step 2 of 16", silent=True))
    console.print(live_view(scene, tracker))
    text = console.export_text()
    assert scene.title in text
    assert "task IN_PROGRESS, pollCount 1, heartbeats seen 1" in text
    assert "times the task out in 1.9s" in text
    assert "running, lease deadline in 1.9s" in text
    assert "pids 11, 12: 2 alive; last output: working: step 2 of 16" in text
    assert "SILENT" in text
    assert "heartbeat 1: extendLease acknowledged" in text

    verdict = tracker.verdict()
    assert not verdict.ok
    assert plain_verdict(verdict).startswith("   FAIL: ")


def test_the_intro_names_the_task_script_the_demo_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli.demo import intro

    repo = tmp_path / "repo"
    (repo / "sample_tasks").mkdir(parents=True)
    packaged = tmp_path / "site-packages" / "leasecore" / "sample_tasks" / "demo_long.py"
    monkeypatch.chdir(repo)
    assert "the task sample_tasks/demo_long.py\n" in intro(SETTINGS, repo / "sample_tasks" / "demo_long.py")
    assert f"the task {packaged}\n" in intro(SETTINGS, packaged)  # an installed wheel's copy, elsewhere
