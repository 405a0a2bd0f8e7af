"""``log_level`` through the real commands (embedded server): a runner started at ``warning`` logs none
of a task's info and debug lines; ``conductor-run reload`` with ``log_level = "debug"`` in its file
makes them appear for the next task, and SIGHUP turns them off and on again.

The lines looked for are ones the runner really logs for every task: ``task ID (...) started: pid N``
(info), ``task ID: reported COMPLETED`` (debug) and the HTTP client's ``POST ... -> HTTP 200`` (debug).
That each task really ran is read from the file its child wrote, not from the log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from cli import exitcodes
from tests.integration.helpers import World
from tests.support import wait_until

# The child writes its task id into $RECORDS: proof that it ran whatever the log says.
RECORDING = 'printf ran > "$RECORDS/$CONDUCTOR_TASK_ID"'


def _config(world: World, records_dir: Path, level: str) -> str:
    return (f'[server]\nurl = "{world.server.url}"\n\n'
            f'[worker]\nstate_dir = "{world.state_dir}"\npoll_timeout = 500\nlog_level = "{level}"\n\n'
            f'[[task]]\ntype = "{world.task_type}"\nshell = \'{RECORDING}\'\n'
            f'env = {{ RECORDS = "{records_dir}" }}\n')


def _operate(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    argv = [sys.executable, "-m", "cli", *args, "--state-dir", str(world.state_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def _one_task(world: World, records_dir: Path) -> str:
    """Start a workflow, wait for it to complete; the id of its task (whose child wrote its file)."""
    wf = world.start_workflow()
    wait_until(lambda: world.workflow_status(wf) == "COMPLETED", timeout_seconds=30,
               what="the task to complete")
    task_id = str(world.task_of(wf)["taskId"])
    assert (records_dir / task_id).read_text() == "ran"
    return task_id


def _started(task_id: str) -> str:
    return f"task {task_id} ("  # "task ID (TYPE, workflow WF) started: pid N"


def _reported(task_id: str) -> str:
    return f"task {task_id}: reported COMPLETED"


def test_reload_and_sighup_change_the_log_level_live(world: World) -> None:
    world.define(response_timeout=10)
    records_dir = world.tmp / "records"
    records_dir.mkdir()
    config = world.tmp / "conductor.toml"
    config.write_text(_config(world, records_dir, "warning"))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    log_path = world.tmp / "runner.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "--config", str(config)], cwd=world.tmp,
                                env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    world.procs.append(proc)
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")

    # At warning: the task runs, and none of its info or debug lines is logged.
    quiet = _one_task(world, records_dir)

    config.write_text(_config(world, records_dir, "debug"))
    reloaded = _operate(world, "reload")
    assert reloaded.returncode == exitcodes.OK, reloaded.stderr
    assert f"runner {proc.pid}: reloaded: [worker] log_level: warning -> debug" in reloaded.stdout
    before_reload = log_path.read_text().split("reloaded the configuration (conductor-run reload)")[0]
    assert "started: pid" not in before_reload and "reported" not in before_reload, before_reload
    assert "serving " not in before_reload and "-> HTTP" not in before_reload, before_reload
    assert _started(quiet) not in log_path.read_text()

    # At debug: the next task's info and debug lines appear, and so do the HTTP calls.
    loud = _one_task(world, records_dir)
    wait_until(lambda: _reported(loud) in log_path.read_text(), what="the debug line of the task's report")
    text = log_path.read_text()
    assert f"{_started(loud)}{world.task_type}, workflow " in text and "started: pid" in text
    assert "DEBUG" in text and "-> HTTP 200" in text
    assert _reported(quiet) not in text

    # SIGHUP back to warning: the reload's own line (a warning) says so; the next task logs nothing.
    config.write_text(_config(world, records_dir, "warning"))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded the configuration (SIGHUP): [worker] log_level: debug -> warning"
               in log_path.read_text(), what="the SIGHUP reload to be logged")
    quiet_again = _one_task(world, records_dir)

    # SIGHUP to debug again: the task after it is logged once more.
    config.write_text(_config(world, records_dir, "debug"))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "(SIGHUP): [worker] log_level: warning -> debug" in log_path.read_text(),
               what="the second SIGHUP reload to be logged")
    loud_again = _one_task(world, records_dir)
    wait_until(lambda: _reported(loud_again) in log_path.read_text(), what="the debug line of the report")
    assert proc.poll() is None

    proc.send_signal(signal.SIGTERM)  # every line the runner will ever log is in the file once it exits
    proc.wait(timeout=60)
    text = log_path.read_text()
    assert _started(quiet_again) not in text and _reported(quiet_again) not in text, text
    assert _started(loud_again) in text
