"""Operating a running runner through the real commands: pause, resume, reload, drain (embedded server).

Each test starts the real ``conductor-run run`` and drives it with the real ``conductor-run pause``,
``resume``, ``reload`` and ``drain`` processes, which reach it only through its control socket in the
shared state directory. What left the runner is read from the server (its poll data records every
poll's time), what ran and when from the children's own files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import requests

from cli import exitcodes
from tests.integration.helpers import World
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3.11"

# A child that records its own start and end (epoch seconds) in $RECORDS/<task id>, sleeping the
# input's seconds in between: the overlap of two tasks is read from these files, not from any log.
RECORDING = ("printf 'start %s\\n' \"$(date +%s.%N)\" >> \"$RECORDS/$CONDUCTOR_TASK_ID\"; "
             "sleep \"${CONDUCTOR_INPUT_SECONDS:-1}\"; "
             "printf 'end %s\\n' \"$(date +%s.%N)\" >> \"$RECORDS/$CONDUCTOR_TASK_ID\"")


def operate(world: World, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``conductor-run ARGS --state-dir <the world's>`` to the end."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    argv = [sys.executable, "-m", "cli", *args, "--state-dir", str(world.state_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def last_poll_ms(world: World) -> int:
    """When the server last answered a poll of the world's task type (epoch ms; 0: never)."""
    rows = world.client.request("GET", "/tasks/queue/polldata", params={"taskType": world.task_type}).json()
    return max((int(r["lastPollTime"]) for r in rows), default=0)


def runner_doc(world: World, pid: int) -> dict[str, Any]:
    done = operate(world, "status", "--json")
    assert done.returncode == 0, done.stderr
    (runner,) = [r for r in json.loads(done.stdout)["runners"] if r["pid"] == pid]
    return dict(runner)


def records(directory: Path) -> dict[str, tuple[float, float | None]]:
    """Each task's (start, end) as its child wrote them."""
    found: dict[str, tuple[float, float | None]] = {}
    for path in directory.iterdir():
        marks = dict(line.split() for line in path.read_text().splitlines() if line.strip())
        if "start" in marks:
            found[path.name] = (float(marks["start"]), float(marks["end"]) if "end" in marks else None)
    return found


def test_pause_stops_polling_keeps_the_running_lease_and_resume_takes_the_waiting_task(world: World) -> None:
    world.define(response_timeout=2)
    running_wf = world.start_workflow(seconds=4)
    proc = world.run("--worker-id", "operate-e2e", "--metrics-port", "0")
    wait_until(world.child_pids, what="the first task's child to start")
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", world.stderr(proc))
    assert port is not None, world.stderr(proc)
    metrics = f"http://127.0.0.1:{port.group(1)}"

    paused = operate(world, "pause", world.task_type)
    paused_at = time.time()
    assert paused.returncode == exitcodes.OK, paused.stderr
    assert f"runner {proc.pid}: paused {world.task_type}" in paused.stdout

    # Within 1 s no poll leaves; the task started after that is not taken.
    wait_until(lambda: time.time() >= paused_at + 1.0, what="1 s after the pause")
    waiting_wf = world.start_workflow(seconds=1)
    doc = runner_doc(world, proc.pid)
    assert doc["paused"] == [world.task_type] and doc["stopping"] is False
    shown = operate(world, "status")
    assert f"PAUSED: {world.task_type}" in shown.stdout, shown.stdout
    ready = requests.get(f"{metrics}/readyz", timeout=10)
    assert (ready.status_code, ready.text.strip()) == (200, f"ok: ready; paused: {world.task_type}")
    exposition = requests.get(f"{metrics}/metrics", timeout=10).text
    assert f'conductor_run_task_type_paused{{taskType="{world.task_type}"}} 1.0' in exposition

    # The running task (a 4 s command under a 2 s lease) keeps its heartbeats and completes.
    wait_until(lambda: world.task_of(running_wf).get("status") == "COMPLETED", timeout_seconds=20,
               what="the running task to complete while paused")
    assert world.workflow_status(running_wf) == "COMPLETED"
    assert world.task_of(waiting_wf)["status"] == "SCHEDULED"
    assert world.task_of(waiting_wf)["pollCount"] == 0
    assert last_poll_ms(world) <= (paused_at + 1.0) * 1000, "a poll left the runner more than 1 s after pause"
    assert proc.poll() is None
    assert "paused" in world.stderr(proc)

    resumed = operate(world, "resume")
    resumed_at = time.monotonic()
    assert resumed.returncode == exitcodes.OK, resumed.stderr
    assert f"resumed {world.task_type}" in resumed.stdout and "paused now: none" in resumed.stdout
    wait_until(lambda: world.task_of(waiting_wf)["status"] != "SCHEDULED", timeout_seconds=3,
               what="the waiting task to be taken within 3 s of the resume")
    assert time.monotonic() - resumed_at <= 3.5
    wait_until(lambda: world.workflow_status(waiting_wf) == "COMPLETED", timeout_seconds=20,
               what="the resumed task to complete")
    assert runner_doc(world, proc.pid)["paused"] == []
    exposition = requests.get(f"{metrics}/metrics", timeout=10).text
    assert f'conductor_run_task_type_paused{{taskType="{world.task_type}"}} 0.0' in exposition


def test_a_long_poll_in_flight_at_the_pause_hands_back_what_it_claims_unmarked(world: World) -> None:
    world.define(response_timeout=30)
    records_dir = world.tmp / "records"
    records_dir.mkdir()
    proc = world.run("--poll-timeout", "5000", command=["/bin/sh", "-c", RECORDING],
                     env={"RECORDS": str(records_dir)})
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")
    # The runner's first long poll (5 s) is out now, waiting on the empty queue.
    assert operate(world, "pause").returncode == exitcodes.OK
    wf = world.start_workflow(seconds=1)  # the poll in flight claims it at once
    wait_until(lambda: "handing its 1 task(s) back" in world.stderr(proc), what="the claim handed back")
    # The line is logged as the hand-back goes out: its update may still be on its way to the server.
    wait_until(lambda: world.task_of(wf)["status"] != "IN_PROGRESS", what="the hand-back to reach the server")
    task = world.task_of(wf)
    # Handed back unmarked: SCHEDULED again at once for any worker, no retry spent, never run here.
    assert (task["status"], task["pollCount"], task["retryCount"]) == ("SCHEDULED", 1, 0), task
    assert list(records_dir.iterdir()) == []
    assert operate(world, "resume").returncode == exitcodes.OK
    wait_until(lambda: world.workflow_status(wf) == "COMPLETED", timeout_seconds=20, what="the task to run")
    assert len(list(records_dir.iterdir())) == 1


def test_pause_of_an_unknown_type_is_refused_and_no_runner_is_no_runner(world: World) -> None:
    none = operate(world, "pause")
    assert none.returncode == exitcodes.NO_RUNNER, (none.stdout, none.stderr)
    assert "no runner answered" in none.stderr

    world.define(response_timeout=2)
    proc = world.run()
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")
    refused = operate(world, "pause", "no_such_type")
    assert refused.returncode == exitcodes.REFUSED, refused.stderr
    assert "does not serve no_such_type" in refused.stderr
    other = operate(world, "resume", "--runner", str(proc.pid + 100000))
    assert other.returncode == exitcodes.REFUSED or other.returncode == exitcodes.NO_RUNNER, other.stderr


def _config(
    world: World, records_dir: Path, *, concurrency: int, url: str | None = None, extra: str = "",
    worker: str = "",
) -> str:
    return (f'[server]\nurl = "{url or world.server.url}"\n\n[worker]\nstate_dir = "{world.state_dir}"\n'
            f"poll_timeout = 500\n{worker}\n[[task]]\ntype = \"{world.task_type}\"\n"
            f"shell = '''{RECORDING}'''\nconcurrency = {concurrency}\n"
            f'env = {{ RECORDS = "{records_dir}" }}\n{extra}')


def test_reload_raises_concurrency_and_refuses_a_broken_file_or_a_restart_only_key(world: World) -> None:
    world.define(response_timeout=5)
    records_dir = world.tmp / "records"
    records_dir.mkdir()
    config = world.tmp / "conductor.toml"
    config.write_text(_config(world, records_dir, concurrency=1))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    log = (world.tmp / "runner.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "--config", str(config)], cwd=world.tmp,
                            env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    world.procs.append(proc)
    try:
        first = [world.start_workflow(seconds=3) for _ in range(2)]
        wait_until(lambda: len(records(records_dir)) == 1, what="one task to start")
        assert len(records(records_dir)) == 1  # concurrency 1: the other waits

        config.write_text(_config(world, records_dir, concurrency=2))
        reloaded = operate(world, "reload")
        assert reloaded.returncode == exitcodes.OK, reloaded.stderr
        assert f"runner {proc.pid}: reloaded: task {world.task_type}: concurrency: 1 -> 2" in reloaded.stdout

        # Two more: with 2 slots, two commands run at once (their own records overlap).
        more = [world.start_workflow(seconds=3) for _ in range(2)]
        for wf in (*first, *more):
            wait_until(lambda wf=wf: world.workflow_status(wf) == "COMPLETED", timeout_seconds=40,
                       what="every task to complete")
        spans = sorted((start, end) for start, end in records(records_dir).values() if end is not None)
        assert len(spans) == 4
        overlapping = any(a_end > b_start for (_a_start, a_end), (b_start, _b_end) in pairwise(spans))
        assert overlapping, spans

        # A file that does not parse: refused whole, the runner goes on as it was.
        config.write_text(_config(world, records_dir, concurrency=1) + "[[task\n")
        broken = operate(world, "reload")
        assert broken.returncode == exitcodes.REFUSED, broken.stdout
        assert "nothing changed" in broken.stderr and str(config) in broken.stderr

        # A restart-only key (the server URL) with a live one (concurrency): refused, naming it; nothing
        # changes, not even the concurrency.
        config.write_text(_config(world, records_dir, concurrency=3, url="http://127.0.0.1:9/api"))
        moved = operate(world, "reload")
        assert moved.returncode == exitcodes.REFUSED, moved.stdout
        assert "[server] url" in moved.stderr and "restart" in moved.stderr
        assert "-> 3" not in moved.stderr

        config.write_text(_config(world, records_dir, concurrency=2))
        same = operate(world, "reload")
        assert same.returncode == exitcodes.OK, same.stderr
        assert "reloaded: nothing changed" in same.stdout  # still 2: neither refused reload changed it
        assert proc.poll() is None
    finally:
        log.close()
    text = (world.tmp / "runner.log").read_text()
    assert "reload (conductor-run reload) refused" in text


def test_sighup_reloads_instead_of_stopping_and_a_live_pause_survives_it(world: World) -> None:
    world.define(response_timeout=5)
    records_dir = world.tmp / "records"
    records_dir.mkdir()
    config = world.tmp / "conductor.toml"
    config.write_text(_config(world, records_dir, concurrency=1))
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    log_path = world.tmp / "runner.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "--config", str(config)], cwd=world.tmp,
                                env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    world.procs.append(proc)
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")
    assert operate(world, "pause").returncode == exitcodes.OK

    # A reload that leaves the file's paused alone keeps the live pause.
    config.write_text(_config(world, records_dir, concurrency=1, worker='log_format = "json"\n'))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded the configuration (SIGHUP)" in log_path.read_text(),
               what="the reload to be logged")
    assert proc.poll() is None
    assert runner_doc(world, proc.pid)["paused"] == [world.task_type]
    # The reload's own line is the first in the new format: JSON, one object per line.
    (line,) = [line for line in log_path.read_text().splitlines() if "reloaded the configuration" in line]
    assert json.loads(line)["level"] == "warning"
    assert json.loads(line)["message"].endswith("[worker] log_format: text -> json")

    # A reload whose file changes paused wins over the live state.
    assert operate(world, "resume").returncode == exitcodes.OK
    config.write_text(_config(world, records_dir, concurrency=1, worker='log_format = "json"\n',
                              extra="paused = true\n"))
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: f"task {world.task_type}: paused: False -> True" in log_path.read_text(),
               what="the second reload to be logged")
    assert runner_doc(world, proc.pid)["paused"] == [world.task_type]


def test_drain_lets_the_running_task_finish_polls_nothing_more_and_exits_0(world: World) -> None:
    world.define(response_timeout=2)
    running_wf = world.start_workflow(seconds=3)
    proc = world.run()
    wait_until(world.child_pids, what="the child to start")
    drain_at = time.time()
    drained = operate(world, "drain", "--timeout", "30")
    assert drained.returncode == exitcodes.OK, drained.stderr
    assert f"runner {proc.pid}: draining" in drained.stdout
    assert f"runner {proc.pid}: drained and exited" in drained.stdout
    # The drain command returned once the runner had exited, with 0, after its task completed.
    assert proc.poll() == exitcodes.OK, world.stderr(proc)
    assert world.workflow_status(running_wf) == "COMPLETED"
    assert last_poll_ms(world) <= (drain_at + 1.0) * 1000
    later = world.start_workflow(seconds=1)
    assert world.task_of(later)["status"] == "SCHEDULED"
    assert not list(world.state_dir.glob("runner-*.sock")), "the socket outlived its runner"


def test_a_stale_socket_is_ignored_and_removed(world: World) -> None:
    world.define(response_timeout=2)
    proc = world.run()
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")
    proc.kill()  # no cleanup: its socket stays behind
    proc.wait(timeout=30)
    (left,) = world.state_dir.glob("runner-*.sock")
    done = operate(world, "pause")
    assert done.returncode == exitcodes.NO_RUNNER, (done.stdout, done.stderr)
    assert f"runner {proc.pid}: gone" in done.stderr
    assert not left.exists()


needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root, setpriv and /usr/bin/python3.11 to run the client as another user",
)


def _as_nobody(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    packages = [p for p in site.getsitepackages() if p.startswith(str(REPO))] or site.getsitepackages()
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": os.pathsep.join([str(REPO), *packages])}
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-m", "cli", *args,
            "--state-dir", str(world.state_dir)]
    return subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=60, check=False)


@needs_setpriv
def test_another_user_cannot_use_the_socket(world: World) -> None:
    # A state dir below a directory another user may enter (pytest's own are root's, 0700).
    outer = Path(tempfile.mkdtemp(prefix="operate-e2e-", dir="/tmp"))
    try:
        world.state_dir = outer / "state"
        _another_user_is_refused(world, outer)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _another_user_is_refused(world: World, outer: Path) -> None:
    world.define(response_timeout=2)
    proc = world.run()
    wait_until(lambda: list(world.state_dir.glob("runner-*.sock")), what="the control socket")
    (sock,) = world.state_dir.glob("runner-*.sock")
    assert sock.stat().st_mode & 0o777 == 0o600

    # As the runner left it: another user does not even reach the socket.
    kept_out = _as_nobody(world, "pause", "--runner", str(proc.pid))
    assert kept_out.returncode == exitcodes.REFUSED, (kept_out.stdout, kept_out.stderr)
    assert "Permission denied" in kept_out.stderr

    # Opened up by mistake (the directory traversable, the socket 0666): the runner checks the peer
    # itself, refuses and logs it.
    for path in (outer, world.state_dir):
        path.chmod(0o711)
    sock.chmod(0o666)
    refused = _as_nobody(world, "pause", "--runner", str(proc.pid))
    assert refused.returncode == exitcodes.REFUSED, (refused.stdout, refused.stderr)
    assert "may not control this runner" in refused.stderr
    wait_until(lambda: "refused a request from uid 65534" in world.stderr(proc), what="the refusal logged")
    assert runner_doc(world, proc.pid)["paused"] == []
    assert proc.poll() is None
