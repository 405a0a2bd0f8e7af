"""The fork server's reused cgroup v1 groups (``grouppool.GroupPool``), in real v1 hierarchies.

A tree without limits on v1 is started in an empty group of a gone tree, or in a new one the fork
server makes; these tests check from the trees themselves (their own /proc/self/cgroup, their
figures) that a group is reused only when that is as good as a new one: its figures are the new
tree's own, a KILLed tree's group or one with a large leftover charge is removed instead, a reused
group that vanished is replaced, and nothing is left behind (``no_leftover_groups``), not even after
the runner and its fork server are SIGKILLed together. Skipped (saying why) where v1 groups cannot be
made here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.limits import Limits
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.forkserver import grouppool
from leasecore.process.linux import cgroupfs, cgroups
from tests.daemons import Daemon, own_daemon
from tests.support import wait_until

from .process_support import REPO, alive, forkserver_boot_around_spawn, make_task
from .test_process_cgroups import (
    _setup,
    check_no_leftovers,
    daemon_shell,
    end_runner,
    sigkill_runner_and_forkserver,
)

MB = 1 << 20
daemon_cmd = own_daemon(3327)  # each test's own daemon command line, killed after it


@pytest.fixture(autouse=True)
def no_leftover_groups() -> Iterator[None]:
    yield
    check_no_leftovers()


@pytest.fixture
def v1() -> cgroups.CgroupSetup:
    return _setup("v1")


@pytest.fixture(params=["main-thread", "spawner-thread"])
def boot(request: pytest.FixtureRequest) -> str:
    """Where the fork server starts the trees: on its main thread, the whole process moving into the
    group for the start; or on a spawner thread, that thread alone moving (forkserver/launch.py)."""
    return forkserver_boot_around_spawn(threads=request.param == "spawner-thread")


_GATED = 'g=$1; shift; "$@"; s=$?; while [ ! -e "$g" ]; do sleep 0.01; done; exit $s'


def _run(supervisor: Supervisor, spec: CommandSpec) -> tuple[dict[str, float], dict[str, str], str]:
    """Run ``spec`` to its tree's end: its resources, the group it ran in, what it printed. The tree
    waits for a gate after its command, so that its group is read before the tree can be gone."""
    task = make_task()
    gate = Path(tempfile.mkdtemp()) / "gate"
    gated = dataclasses.replace(spec, argv=("sh", "-c", _GATED, "sh", str(gate), *spec.command_argv()),
                                shell=None)  # fmt: skip
    child = supervisor.spawn(task, gated, worker_id="w")
    group = child.cgroup  # the fork server's choice, known once the spawn is answered
    gate.touch()
    exit_ = child.wait(30)
    gate.unlink()
    gate.parent.rmdir()
    assert exit_ is not None and exit_.exit_code == 0, exit_
    assert child.wait_gone(10)
    assert group is not None
    resources = to_task_result(task, exit_, spec, worker_id="w").output_data["resources"]
    return resources, dict(group["dirs"]), exit_.stdout_tail


def _cat_cgroup() -> CommandSpec:
    return CommandSpec(argv=("cat", "/proc/self/cgroup"))


def test_the_next_tree_reuses_the_group_and_gets_only_its_own_figures(
    v1: cgroups.CgroupSetup, boot: str
) -> None:
    heavy = CommandSpec(argv=(sys.executable, "-c", "x = bytearray(60 * 1024 * 1024); sum(range(8_000_000))"))
    with Supervisor(None, cgroup_setup=v1, forkserver_boot=boot) as supervisor:
        first, first_dirs, _ = _run(supervisor, heavy)
        second, second_dirs, printed = _run(supervisor, _cat_cgroup())
        # Its figures are read through files the fork server keeps open while it keeps the group
        # (cgroupfs._read_kept): a third tree's are its own again, not the ones read before.
        third, third_dirs, _ = _run(supervisor, heavy)
        stats = supervisor.forkserver_stats()
    assert second_dirs == first_dirs == third_dirs  # the same group, reused
    name = os.path.basename(next(iter(first_dirs.values())))
    assert printed.count(name) == len(set(first_dirs.values()))  # the tree itself was in it
    assert stats["groups_reused"] >= 2 and stats["groups_made"] == 1
    assert first["max_rss_bytes"] >= 60 * MB
    assert second["max_rss_bytes"] < 8 * MB  # its own peak, not the first tree's 60 MB
    assert first["cpu_user_seconds"] + first["cpu_system_seconds"] >= 0.1
    assert second["cpu_user_seconds"] + second["cpu_system_seconds"] < 0.05  # not the first's CPU
    assert third["max_rss_bytes"] >= 60 * MB  # read anew, from the reset peak
    assert third["cpu_user_seconds"] + third["cpu_system_seconds"] >= 0.1


def test_a_killed_trees_group_is_removed_not_reused(v1: cgroups.CgroupSetup, boot: str) -> None:
    lines: list[str] = []
    stubborn = CommandSpec(shell="trap '' TERM; echo started; while :; do sleep 0.05; done",
                           kill_grace_seconds=0.2)  # fmt: skip
    with Supervisor(None, cgroup_setup=v1, forkserver_boot=boot) as supervisor:
        child = supervisor.spawn(make_task(), stubborn, worker_id="w",
                                 on_line=lambda _s, line: lines.append(line))  # fmt: skip
        assert child.cgroup is not None
        killed_dirs = list(child.cgroup["dirs"].values())
        assert wait_until(lambda: "started" in lines, 10)
        child.terminate_tree()  # TERM ignored: KILL after the grace, the group's KILL with it
        assert child.wait_gone(10)
        assert not any(os.path.exists(path) for path in killed_dirs)  # frozen and thawed: not kept
        _, next_dirs, _ = _run(supervisor, _cat_cgroup())
    assert sorted(next_dirs.values()) != sorted(killed_dirs)


def test_a_group_left_with_a_large_charge_is_removed_not_reused(v1: cgroups.CgroupSetup) -> None:
    # A tmpfs file the tree wrote stays charged to its group after the tree is gone (2 MiB > the 1 MiB
    # a reused group may carry): such a group would skew the next tree's peak.
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    if shm is None:
        pytest.skip("no writable /dev/shm here")
    leftover = shm / f"conductor-run-test-{os.getpid()}"
    writer = CommandSpec(argv=("sh", "-c", f"head -c {2 * MB} /dev/zero > {leftover}"))
    try:
        with Supervisor(None, cgroup_setup=v1) as supervisor:
            _, first_dirs, _ = _run(supervisor, writer)
            assert not any(os.path.exists(path) for path in first_dirs.values())
            _, second_dirs, _ = _run(supervisor, _cat_cgroup())
            assert supervisor.forkserver_stats()["groups_reused"] == 0
        assert second_dirs != first_dirs
    finally:
        leftover.unlink(missing_ok=True)


def test_a_reused_group_removed_meanwhile_is_replaced_by_a_new_one(
    v1: cgroups.CgroupSetup, boot: str
) -> None:
    with Supervisor(None, cgroup_setup=v1, forkserver_boot=boot) as supervisor:
        _, first_dirs, _ = _run(supervisor, _cat_cgroup())
        for path in first_dirs.values():  # free and empty: as another host's sweep might
            os.rmdir(path)
        _, second_dirs, printed = _run(supervisor, _cat_cgroup())
        stats = supervisor.forkserver_stats()
    assert second_dirs != first_dirs and stats["groups_made"] == 2
    assert os.path.basename(next(iter(second_dirs.values()))) in printed


def test_a_start_on_a_spawner_thread_moves_that_thread_alone_into_the_group_and_back(
    v1: cgroups.CgroupSetup, tmp_path: Path
) -> None:
    """While a spawner thread's start waits (held before libc's posix_spawn, after the join), that
    thread is in the new tree's group and every other thread of the fork server, its main one first,
    is where it started; the command is born in the group, and then every thread is back home."""
    gate = tmp_path / "gate"
    boot = forkserver_boot_around_spawn(
        f"while 'held' in argv and not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)")
    with Supervisor(None, cgroup_setup=v1, forkserver_boot=boot) as supervisor:
        forkserver = supervisor.forkserver_pid
        home = Path(f"/proc/{forkserver}/cgroup").read_text()

        def threads() -> dict[int, str]:
            return {int(tid): Path(f"/proc/{forkserver}/task/{tid}/cgroup").read_text()
                    for tid in os.listdir(f"/proc/{forkserver}/task")}  # fmt: skip

        lines: list[str] = []
        groups: list[dict[str, object] | None] = []  # the group named in the answer (gone with the tree)
        child = supervisor.start(make_task(), CommandSpec(argv=("sh", "-c", "cat /proc/self/cgroup", "held")),
                                 worker_id="w", on_lines=lambda _s, got: lines.extend(got),
                                 on_started=lambda started: groups.append(started.cgroup))  # fmt: skip
        assert wait_until(lambda: any(text != home for text in threads().values()), 10)
        moved = {tid: text for tid, text in threads().items() if text != home}
        assert len(moved) == 1 and forkserver not in moved  # one spawner thread, never the main one
        assert threads()[forkserver] == home
        gate.touch()
        exit_ = child.wait(30)
        assert exit_ is not None and exit_.exit_code == 0, exit_
        assert child.wait_gone(10)
        (group,) = groups
        assert group is not None
        dirs = set(group["dirs"].values())  # type: ignore[attr-defined]
        name = os.path.basename(next(iter(dirs)))
        assert name in next(iter(moved.values()))  # the group that thread was in: the tree's
        assert sum(name in line for line in lines) == len(dirs)
        assert all(text == home for text in threads().values())
        assert supervisor.forkserver_stats()["spawner_threads"] >= 1


def test_the_pool_keeps_at_most_its_bound(v1: cgroups.CgroupSetup) -> None:
    pool = grouppool.GroupPool(most=1)
    made = [pool.take(cgroups.pool_request(v1, f"bound{i}", Limits()))[0] for i in range(2)]
    try:
        assert pool.give_back(made[0])
        assert not pool.give_back(made[1])  # full: the caller removes it
        again, reused = pool.take(cgroups.pool_request(v1, "again", Limits()))
        assert reused and again["dirs"] == made[0]["dirs"] and "base" in again
        assert len(pool) == 0 and pool.made == 2 and pool.reused == 1
    finally:
        for group in made:
            assert cgroupfs.remove(group)


def test_the_accounting_files_kept_open_stay_within_their_bound_and_close_with_their_group(
    v1: cgroups.CgroupSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pooled group's peak, cpuacct.stat and oom_control stay open while it is kept (cgroupfs
    # _read_kept): three per group, all closed past the bound (no EMFILE however many groups).
    monkeypatch.setattr(cgroupfs, "_KEPT_FDS", {})
    monkeypatch.setattr(cgroupfs, "_KEPT_FDS_MOST", 6)
    pool = grouppool.GroupPool()
    made = [pool.take(cgroups.pool_request(v1, f"kept{i}", Limits()))[0] for i in range(3)]
    try:
        sizes = []
        for group in made:
            assert pool.give_back(group)  # recycle: read through kept fds
            sizes.append(len(cgroupfs._KEPT_FDS))
        assert sizes[0] == 3 and max(sizes) <= 6, sizes
        fds = list(cgroupfs._KEPT_FDS.values())
        for group in made:
            assert cgroupfs.remove(group)
        assert cgroupfs._KEPT_FDS == {}  # removing a group closes its files
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        for group in made:
            cgroupfs.remove(group)


# --- what a dead runner left: its empty groups go at the next start's sweep, nothing else does ---------


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def test_the_sweep_removes_only_empty_groups_of_dead_runners(v1: cgroups.CgroupSetup) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody has now (a runner that died)
    live, member = _sleeper(), _sleeper()
    home = v1.dirs["freezer"]
    names = {
        "dead_empty": f"{cgroups.GROUP_PREFIX}{gone.pid}.a",
        "live_empty": f"{cgroups.GROUP_PREFIX}{live.pid}.b",
        "dead_held": f"{cgroups.GROUP_PREFIX}{gone.pid}.c",
        "not_ours": f"other.{gone.pid}.d",
    }
    paths = {key: os.path.join(home, name) for key, name in names.items()}
    for path in paths.values():
        os.mkdir(path)
    try:
        Path(paths["dead_held"], "cgroup.procs").write_text(str(member.pid))
        cgroups.remove_empty_groups(v1, own=False)
        assert not os.path.exists(paths["dead_empty"])
        assert all(os.path.isdir(paths[key]) for key in ("live_empty", "dead_held", "not_ours"))
    finally:
        for process in (live, member):
            process.kill()
            process.wait()
        for path in paths.values():
            if os.path.isdir(path):
                assert wait_until(lambda path=path: not cgroupfs.populated({"v": 1, "dirs": {"x": path}}), 5)
                os.rmdir(path)


RUNNER = """
import json, sys, time
from pathlib import Path
from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import cgroups

state_dir, shell = sys.argv[1], sys.argv[2]
sup = Supervisor(Path(state_dir), cgroup_setup=cgroups.detect("v1"))
task = Task(task_id="t", workflow_id="w", task_type="x")
# Two trees at once, both gone: two free groups; the daemon's tree takes one, the other stays free.
firsts = [sup.spawn(task, CommandSpec(argv=("sleep", "0.2")), worker_id="w") for _ in range(2)]
groups = [c.cgroup for c in firsts]
assert all(c.wait(20) is not None and c.wait_gone(10) for c in firsts)
lines = []
child = sup.spawn(task, CommandSpec(shell=shell), worker_id="w", on_line=lambda s, l: lines.append(l))
free = next(g for g in groups if g["dirs"] != child.cgroup["dirs"])
deadline = time.monotonic() + 30
while "started" not in lines and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"forkserver": sup.forkserver_pid, "free": free, "group": child.cgroup,
                  "free_left": sup.forkserver_stats()["groups_free"]}), flush=True)
time.sleep(600)
"""
def test_a_free_group_left_by_a_sigkilled_runner_and_fork_server_goes_at_the_next_sweep(
    v1: cgroups.CgroupSetup, tmp_path: Path, daemon_cmd: Daemon
) -> None:
    """The runner's first tree is gone (its group free in the pool), its second runs a daemon; both
    processes are SIGKILLed: the next start's sweep kills the daemon through its recorded group and
    removes both groups, the free one by its dead runner's name."""
    state = tmp_path / "state"
    argv = [sys.executable, "-c", RUNNER, str(state), daemon_shell(daemon_cmd)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, process_group=0)
    info: dict[str, object] = {}
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert wait_until(lambda: bool(daemon_cmd.running()), 10)
        (daemon,) = daemon_cmd.running()
        sigkill_runner_and_forkserver(proc, int(info["forkserver"]))  # type: ignore[call-overload]
        free = list(info["free"]["dirs"].values())  # type: ignore[index]
        held = list(info["group"]["dirs"].values())  # type: ignore[index]
        assert info["free_left"] == 1 and free != held  # one free group (no tree), one held (a tree)
        assert all(os.path.isdir(path) for path in free + held)
        with Supervisor(state, cgroup_setup=v1) as supervisor:
            killed = supervisor.sweep_leftovers()
        assert daemon.pid in killed
        assert wait_until(lambda: not alive(daemon), 5)
        assert not any(os.path.exists(path) for path in free + held)
    finally:
        end_runner(proc, daemon_cmd)
        for key in ("free", "group"):  # named by the dead runner's pid: the fixture checks only ours
            group = info.get(key)
            if isinstance(group, dict):
                cgroupfs.kill(group)
                assert wait_until(lambda group=group: cgroupfs.remove(group), 5)
